"""The typed run configuration: one pydantic section per component, unknown keys rejected.

The algorithm section (a union keyed on `algorithm.name`) is in keel.config.algorithms, the
Section base in keel.config.section. Old keys are mapped to their new place before validation
(keel.config.legacy). Cross-field checks (batch algebra) live in `keel.config.derived` (which
imports this module for types only) and run before any model loads. Every number must be finite
(NaN and ±inf are errors naming the key), except `algorithm.policy_loss.clip_ratio_c`, where
`.inf` disables the dual clip.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

from keel.config.algorithms import Algorithm, CorrectionPreset
from keel.config.derived import check_batch_algebra, check_lora
from keel.config.legacy import rollout_decode, upgrade, warn_renamed
from keel.config.section import FiniteMapping, Section, Seed


class LoraConfig(Section):
    """A LoRA adapter on the actor (peft): only the adapter trains; the reference policy is the
    base model with the adapter disabled, and the exported model/ folder is merged."""

    r: int = Field(default=8, ge=1, description="rank of the adapter")
    alpha: float = Field(default=16.0, gt=0, description="scale: the update is alpha / r · B·A")
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear", description="module names (e.g. [q_proj, v_proj]) or all-linear"
    )


class ModelsConfig(Section):
    """Where each role's model comes from: a local HF folder, a Hugging Face hub id (`org/name`,
    read from the local HF cache), or `builtin:NAME`."""

    actor: str = Field(
        description="HF causal-LM folder of the policy, a hub id (org/name) in the HF cache, "
        "or builtin:tiny"
    )
    reference: str | None = Field(
        default=None, description="reference policy; default: same as actor"
    )
    critic: str | None = None
    reward: str | None = Field(
        default=None, description="reward-model folder (RL: scores rollouts)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="compute precision: trained models keep float32 weights and optimizer "
        "states and run forward/backward under autocast in this dtype; frozen models "
        "(reference, reward model, a separate rollout copy) are stored in it",
    )
    pure_low_precision: bool = Field(
        default=False,
        description="trained models' weights and optimizer states in models.dtype too (no "
        "float32 master copy; small updates round away): only when asked, with a warning",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        default=None,
        description="the attention kernel transformers uses; null: transformers' default",
    )
    lora: LoraConfig | None = Field(
        default=None, description="train a LoRA adapter (peft) instead of every weight of the actor"
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="the branch, tag or commit of every model given by hub id; null: main",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="let transformers run model and tokenizer code a model folder ships "
        "(auto_map in its config); only for models you trust",
    )


class ArithmeticConfig(Section):
    """The built-in integer-arithmetic task (`37+45=` → `82`)."""

    max_operand: int = Field(
        default=99, ge=1, description="operands are drawn from [0, max_operand]"
    )
    ops: str = Field(default="+", pattern=r"^[+\-*]+$", description="operators to draw from: + - *")
    eval_size: int = Field(
        default=200, ge=1, description="held-out problems, never seen in training"
    )
    seed: Seed = 0


class DataColumns(Section):
    """The field of a data row that holds each part (JSONL keys, Parquet columns)."""

    prompt: str = "prompt"
    answer: str = "answer"
    response: str = "response"
    messages: str = Field(
        default="messages",
        description="a row without a prompt field: chat messages; before the last assistant "
        "message = the prompt, that message = the response",
    )
    chosen: str = Field(default="chosen", description="preference pairs: the preferred response")
    rejected: str = Field(default="rejected", description="preference pairs: the other response")
    tools: str = Field(
        default="tools",
        description="a row's tool definitions (OpenAI function schemas), passed to the chat "
        "template as tools=",
    )


class DataConfig(Section):
    """Training and evaluation data: `builtin:arithmetic` or JSONL/Parquet files."""

    train: str = Field(
        default="builtin:arithmetic",
        description="builtin:arithmetic, builtin:preference (pairs) or a .jsonl/.parquet",
    )
    eval: str | None = Field(
        default=None,
        description="held-out data; default: the arithmetic held-out split when training "
        "on builtin:arithmetic, otherwise no evaluation",
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        default="raise",
        description="a malformed row: raise (error naming file:line) or skip it and count it",
    )
    columns: DataColumns = Field(
        default_factory=lambda: DataColumns(), description="the names of a row's fields"
    )
    train_on: Literal["last", "all_assistant"] = Field(
        default="last",
        description="SFT on a messages row: last (its last assistant message, the messages "
        "before it the prompt) or all_assistant (every assistant turn, in the token layout "
        "of a played episode; observations masked out)",
    )
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description="tool definitions for every row without its own (OpenAI function schemas)",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        default="auto",
        description="how the model writes tool calls (episodes, SFT data): auto = from the "
        "tokenizer's chat template (<tool_call> hermes, [TOOL_CALLS] mistral, <|python_tag|> "
        "llama3_json, else hermes)",
    )
    apply_chat_template: bool = False
    max_prompt_length: int = Field(default=64, ge=1)
    truncation: Literal["error", "left", "drop"] = Field(
        default="error",
        description="a prompt longer than max_prompt_length: error (naming file:line), left "
        "(keep its last max_prompt_length tokens) or drop (leave it out, counted)",
    )
    shuffle: bool = True
    arithmetic: ArithmeticConfig = ArithmeticConfig()


class RewardModelConfig(Section):
    """Scoring with a reward model (`models.reward`): weights, running normalisation, clipping.

    score = weight · clip(normalise(RM score)) + fn_weight · reward.fn (rule reward; with
    reward.fns, fn_weight · Σ weight_k · fn_k)."""

    weight: float = Field(default=1.0, description="weight of the reward model's score")
    fn_weight: float = Field(
        default=0.0,
        description="weight of the rule reward reward.fn (or reward.fns' weighted sum); 0 does "
        "not call it",
    )
    normalize: bool = Field(
        default=False, description="running z-score of the RM score (all steps)"
    )
    clip: float | None = Field(
        default=None, gt=0, description="clip the (normalised) RM score to ±clip"
    )


class RewardHTTPConfig(Section):
    """Requests to a reward service (reward.url)."""

    timeout_s: float = Field(default=30.0, gt=0, description="time limit of one request attempt")
    retries: int = Field(
        default=3,
        ge=0,
        description="retries of a request that failed to connect, timed out, or got "
        "429 or a 5xx status",
    )
    backoff_s: float = Field(default=0.5, ge=0, description="wait before retry k: backoff_s · 2^k")
    api_key_env: str = Field(
        default="KEEL_REWARD_API_KEY",
        description="environment variable holding a bearer token for the service (unset: none)",
    )


def _http_url(url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return url


# reward/<name> metrics the step already logs: reward.fns names may not take them.
RESERVED_REWARD_NAMES = frozenset(
    {"mean", "std", "max", "min", "errors", "all_equal_frac", "fn_mean", "model_mean",
     "model_std", "model_shaped_mean"}
)  # fmt: skip


def reward_fn_name(fn: str) -> str:
    """The default metric name of reward function `fn`: the part after its last `:`
    (`builtin:math` → `math`, `rewards.py:format_ok` → `format_ok`)."""
    return fn.rpartition(":")[2] or fn


class RewardFnConfig(Section):
    """One of several reward functions (reward.fns): the step's reward is Σ weight · score."""

    fn: str = Field(description="builtin:NAME, module:fn or file.py:fn")
    weight: float = Field(default=1.0, description="its weight in the sum Σ weight · score")
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="logged as reward/<name>; default: the part of fn after its last ':'",
    )
    kwargs: FiniteMapping = Field(
        default_factory=dict, description="keyword arguments, on top of reward.kwargs"
    )
    signature: Literal["row", "trl"] | None = Field(
        default=None, description="null: reward.signature"
    )

    def metric_name(self) -> str:
        """`name`, or the one derived from `fn`."""
        return self.name or reward_fn_name(self.fn)


class RewardConfig(Section):
    """The reward: a built-in verifier, a user function `module:fn` / `path/file.py:fn`, several
    weighted functions (`fns`), or an HTTP reward service (`url`)."""

    fn: str | None = Field(
        default=None,
        description="builtin:NAME, module:fn or file.py:fn; default builtin:numeric_match, "
        "null when reward.fns is set",
    )
    fns: list[RewardFnConfig] | None = Field(
        default=None,
        description="several reward functions instead of fn: score = Σ weight · fn, each "
        "logged as reward/<name>",
    )
    url: Annotated[str | None, AfterValidator(_http_url)] = Field(
        default=None,
        description="score through an HTTP reward service (keel serve --reward, docs/serving.md) "
        "instead of reward.fn",
    )
    http: RewardHTTPConfig = RewardHTTPConfig()
    batch_size: int = Field(
        default=64, ge=1, description="rows per request to reward.url and per reward-model forward"
    )
    signature: Literal["row", "trl"] = Field(
        default="row",
        description="row: fn(prompt, response, answer, **kwargs) -> float per row; trl: "
        "fn(prompts=, completions=, <data.columns.answer>=, **kwargs) -> list[float] per batch",
    )
    kwargs: FiniteMapping = Field(default_factory=dict)
    on_error: Literal["raise", "fallback"] = "raise"
    fallback_score: float = 0.0
    model: RewardModelConfig = RewardModelConfig()
    timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        description="per-call time limit; a call past it is an error; null: none",
    )
    max_concurrency: int = Field(
        default=1, ge=1, description="reward calls running at once (threads)"
    )
    max_hung_calls: int = Field(
        default=32,
        ge=1,
        description="stop the run when this many timed-out calls are still running",
    )
    max_abs: float | None = Field(
        default=None,
        gt=0,
        description="a score with |score| above this is an error; null: no bound",
    )
    max_error_rate: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="stop the run when a step's errored fraction exceeds this",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_fn(cls, data: Any) -> Any:
        """reward.fn defaults to builtin:numeric_match unless reward.fns is set."""
        if isinstance(data, dict) and data.get("fn") is None and data.get("fns") is None:
            return {**data, "fn": "builtin:numeric_match"}
        return data

    @model_validator(mode="after")
    def _one_way_to_score(self) -> RewardConfig:
        if self.fns is None:
            return self
        if not self.fns:
            raise ValueError("reward.fns is empty: list one {fn, weight} or more, or use reward.fn")
        if self.fn is not None:
            raise ValueError(
                "reward.fn and reward.fns are mutually exclusive: list the function in "
                "reward.fns (with its weight) and remove reward.fn"
            )
        if self.url is not None:
            raise ValueError("reward.url and reward.fns are mutually exclusive")
        seen: dict[str, int] = {}
        for i, part in enumerate(self.fns):
            name = part.metric_name()
            if name in RESERVED_REWARD_NAMES:
                raise ValueError(
                    f"reward.fns[{i}].name: reward/{name} is a metric Keel logs already; "
                    "choose another name"
                )
            if name in seen:
                raise ValueError(
                    f"reward.fns[{i}].name: {name!r} is the name of reward.fns[{seen[name]}] "
                    "too; give each function its own name (logged as reward/<name>)"
                )
            seen[name] = i
        return self


class VLLMConfig(Section):
    """Options of the vLLM rollout engine (rollout.engine: vllm; the `keel[vllm]` extra)."""

    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="fraction of GPU memory vLLM may take (weights + KV cache)",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="longest prompt + response; null: the model's context length",
    )
    kv_cache_space_gb: float = Field(
        default=1.0,
        gt=0,
        description="KV-cache memory on CPU, in GiB (vLLM's kv_cache_memory_bytes)",
    )
    lora_adapters: Literal["auto", "off"] = Field(
        default="auto",
        description="with models.lora: auto, the engine is built with LoRA and each push sends "
        "the adapter only (megabytes), where vLLM can apply it (else the merged weights, the "
        "reason logged once); off: the merged weights, always",
    )
    engines: int = Field(
        default=1,
        ge=1,
        description="vLLM engines, each in a process of its own behind a router "
        "(keel.rollout.pool); 1: one engine in the rollout worker's process",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="devices each engine's model is split over (vLLM's tensor parallelism)",
    )


class EnvConfig(Section):
    """The environment a run's episodes are played in (rollout.env), and the episodes' limits."""

    name: str = Field(
        description="builtin:NAME, module:Class or file.py:Class, or http: an environment "
        "server at rollout.env.url (docs/environments.md)"
    )
    url: Annotated[str | None, AfterValidator(_http_url)] = Field(
        default=None,
        description="with name http: the environment server (keel env serve, or any server of "
        "the keel-env protocol), e.g. http://127.0.0.1:8711",
    )
    http_retries: int = Field(
        default=3,
        ge=0,
        description="with name http: retries of a call to the server that failed to connect, "
        "timed out or got 429 or a 5xx status (after 0.2 s · 2^k; every call of the protocol "
        "can be retried)",
    )
    retries: int = Field(
        default=2,
        ge=0,
        description="an episode whose environment (or agent) raised, timed out or was lost is "
        "played again from the start with a fresh environment (an agent: a fresh gateway "
        "session), up to this many times; one that still fails drops its whole group from the "
        "step",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="time limit of one reset or step: past it an in-process environment's "
        "attempt at the episode failed; with name http, of one call attempt (then retried, "
        "http_retries); with name agent, of one whole call of the agent (an attempt). null: "
        "none in-process and for an agent, 30 s with name http",
    )
    max_failed_frac: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="stop the run when more than this fraction of a generate call's episodes "
        "(a step's, an evaluation chunk's) failed after their retries",
    )
    kwargs: FiniteMapping = Field(
        default_factory=dict, description="keyword arguments of the environment's constructor"
    )
    max_turns: int = Field(default=1, ge=1, description="the policy's turns per episode")
    max_episode_tokens: int | None = Field(
        default=None,
        ge=1,
        description="response tokens of an episode, the policy's and the observations'; "
        "null: no limit besides max_turns × max_new_tokens and the observations",
    )
    turn_discount: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="γ: an episode's environment rewards add up to Σ_k γ^k r_k",
    )
    workers: int = Field(default=8, ge=1, description="environment steps (tool calls) run at once")
    require_bubblewrap: bool = Field(
        default=True,
        description="the python tool's sandbox must have its outer layer, bubblewrap: "
        "`keel train` exits 2 where it does not work; false: run the code with the inner "
        "layers only (a warning event says so; docs/tools.md)",
    )
    agent: str | None = Field(
        default=None,
        description="with name agent: the user's agent, path/to/file.py:function or "
        "package.module:function, called once per episode with an openai client on the "
        "training gateway and the example; it returns the episode's reward "
        "(docs/environments.md)",
    )

    @model_validator(mode="after")
    def _agent_needs_function(self) -> EnvConfig:
        if self.name == "agent" and self.agent is None:
            raise ValueError(
                "rollout.env.name agent needs rollout.env.agent (path/to/file.py:function)"
            )
        if self.agent is not None and self.name != "agent":
            raise ValueError(
                f"rollout.env.agent is for rollout.env.name agent, not {self.name!r}: set "
                "name: agent, or drop agent"
            )
        return self

    @model_validator(mode="after")
    def _http_needs_url(self) -> EnvConfig:
        if self.name == "http" and self.url is None:
            raise ValueError("rollout.env.name http needs rollout.env.url (the server's URL)")
        if self.url is not None and self.name != "http":
            raise ValueError(
                f"rollout.env.url is for rollout.env.name http, not {self.name!r}: set name: "
                "http, or drop url"
            )
        return self


# The hf engine's decode paths (rollout.decode; docs/rollout.md): Keel's loop, dynamic or at
# fixed shapes, or HF generate on the device's cache, the static one or Keel's reserved one.
DecodePath = Literal["keel", "keel-static", "generate", "generate-static", "generate-reserved"]


class RolloutConfig(Section):
    """Sampling: n responses per prompt (the group), temperature, nucleus, length; the engine
    that generates and how far behind the trainer it may run."""

    engine: Literal["hf", "vllm"] = Field(
        default="hf",
        description="hf: transformers generate; vllm: the vLLM engine (keel[vllm] extra)",
    )
    vllm: VLLMConfig = VLLMConfig()
    max_staleness: int = Field(
        default=0,
        ge=0,
        description="k ≥ 1: the next batches are generated while the current one trains, with "
        "weights at most k updates old; 0: synchronous",
    )
    interruptible: bool = Field(
        default=False,
        description="with max_staleness ≥ 1: a weight push reaches the batch generating ahead "
        "mid-generation; its rows still running at decode step interrupt_at continue under "
        "the new weights (their KV cache computed again), every token recording the version "
        "that sampled it (Batch.token_weight_versions). HF engine on Keel's decode loop or "
        "vLLM, rollout in the trainer's process; with HF generate rows finish under the "
        "version they started with (docs/rollout.md)",
    )
    interrupt_at: int | None = Field(
        default=None,
        ge=1,
        description="the decode step (a row's token index) at which an interruptible "
        "rollout's unfinished rows take the pushed weights; null: max_new_tokens // 2",
    )
    n: int = Field(
        default=8, ge=1, description="responses sampled per prompt (the GRPO group size)"
    )
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=16, ge=1)
    batch_size: int | None = Field(default=None, ge=1, description="prompts per generate call")
    return_logprobs: bool = Field(
        default=False, description="keep the engine's log-probs and log their gap to the trainer's"
    )
    quantization: Literal["int8", "fp8"] | None = Field(
        default=None,
        description="hf engine: its own copy of the policy with the Linear layers quantized "
        "(embeddings and LM head kept), re-quantized from each full-precision weight push; the "
        "trainer keeps full precision. int8: CPU, int8 weights per channel and activations per "
        "token multiplied in integers (torch._int_mm); fp8: CUDA, weight-only float8_e4m3fn per "
        "channel (untested here). Pair with return_logprobs and algorithm.rollout_correction "
        "(docs/rollout.md); null: full precision",
    )
    quantization_lm_head: bool = Field(
        default=False,
        description="with quantization: the LM head quantized too (tied to the embeddings or "
        "not: the embeddings stay float); faster, a larger log-prob gap (docs/rollout.md)",
    )
    share_prompt_prefill: bool = Field(
        default=True,
        description="the n responses of a prompt share one prefill pass of it (a KV cache "
        "repeated n times), with the reserved or the static KV cache",
    )
    decode: DecodePath | None = Field(
        default=None,
        description="the hf engine's decode path: keel, Keel's own decode loop on the reserved "
        "KV cache (a forward over the live rows per step, finished rows dropped); keel-static: "
        "the same loop, its decode steps at padded batch buckets on a static cache, on CUDA "
        "each captured once in a CUDA graph (FSDP2 runs it as keel); generate: HF generate on "
        "the device's cache (transformers' static cache on CUDA, Keel's reserved one "
        "elsewhere); generate-static, generate-reserved: HF generate on that cache. A model "
        "with sliding-window or other non-full-attention layers decodes with generate. null: "
        "keel on the CPU, generate on CUDA",
    )
    compile: bool | None = Field(
        default=None,
        description="compiled decoding: hf torch.compiles the model for rollout.decode keel "
        "(dynamic shapes) or has transformers compile the decode step of generate on the "
        "static cache (CUDA); vllm uses CUDA graphs and torch.compile (vLLM's enforce_eager "
        "off: slower start-up, faster decoding); null: hf on CUDA, vllm off",
    )
    env: EnvConfig | None = Field(
        default=None,
        description="multi-turn episodes in an environment (docs/environments.md); null: one "
        "response per prompt",
    )

    @model_validator(mode="after")
    def _quantization_on_hf(self) -> RolloutConfig:
        if self.quantization_lm_head and self.quantization is None:
            raise ValueError("rollout.quantization_lm_head needs rollout.quantization")
        if self.quantization is not None and self.engine != "hf":
            raise ValueError(
                "rollout.quantization quantizes the hf engine's weights; with rollout.engine "
                "vllm it is not wired (vLLM's own quantization would have to be re-applied at "
                "each weight push): set rollout.quantization: null"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _old_decode_keys(cls, data: Any) -> Any:
        """rollout.decode_loop and static_cache in their new place, rollout.decode, where no
        whole config was upgraded first (a serve config's rollout section), reported once."""
        if isinstance(data, dict) and ("decode_loop" in data or "static_cache" in data):
            data = dict(data)
            warn_renamed(rollout_decode(data))
        return data

    @model_validator(mode="after")
    def _decode_on_hf(self) -> RolloutConfig:
        if self.decode is not None and self.engine != "hf":
            raise ValueError(
                f"rollout.decode ({self.decode}) chooses the hf engine's decode path; with "
                f"rollout.engine {self.engine} drop it (compiled decoding: rollout.compile)"
            )
        if self.compile and self.decode in ("keel-static", "generate-reserved"):
            why = (
                "its decode steps are CUDA graphs, not compiled"
                if self.decode == "keel-static"
                else "transformers compiles generate's step on the static cache only"
            )
            raise ValueError(
                f"rollout.compile: true does not apply to rollout.decode {self.decode} ({why}): "
                "set rollout.compile to false or null, or rollout.decode to keel or "
                "generate-static"
            )
        return self

    def swap_step(self) -> int:
        """The decode step at which an interruptible rollout's rows take a push."""
        return self.interrupt_at or max(1, self.max_new_tokens // 2)

    @model_validator(mode="after")
    def _interruptible_needs_async(self) -> RolloutConfig:
        if not self.interruptible:
            return self
        if self.max_staleness < 1:
            raise ValueError(
                "rollout.interruptible needs rollout.max_staleness ≥ 1 (a push arrives while "
                "the next batch generates only then)"
            )
        if self.env is not None:
            raise ValueError(
                "rollout.interruptible does not run with rollout.env (an episode's turns "
                "would mix weight versions the episode does not record)"
            )
        if self.swap_step() >= self.max_new_tokens:
            raise ValueError(
                f"rollout.interrupt_at ({self.swap_step()}) must be below "
                f"rollout.max_new_tokens ({self.max_new_tokens})"
            )
        return self

    def response_budget(self) -> int:
        """The most tokens the policy itself says in one episode (one response: max_new_tokens;
        with rollout.env: max_turns of them, at most max_episode_tokens)."""
        if self.env is None:
            return self.max_new_tokens
        budget = self.env.max_turns * self.max_new_tokens
        limit = self.env.max_episode_tokens
        return budget if limit is None else min(budget, limit)


class TrainConfig(Section):
    """Optimisation: steps, the batch algebra, optimizer and LR schedule."""

    steps: int = Field(
        default=100, ge=1, description="training steps (RL: rollout batches; SFT: batches)"
    )
    batch_size: int = Field(
        default=32, ge=1, description="prompts per step (SFT: examples per step)"
    )
    mini_batch_size: int | None = Field(
        default=None, ge=1, description="sequences per optimizer update; default: the whole step"
    )
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="sequences per forward/backward; default: the mini-batch"
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each rollout batch (RL only)")
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = Field(
        default=1.0, gt=0, description="max global grad norm; null: off"
    )
    warmup_steps: int = Field(default=0, ge=0, description="LR warm-up, in optimizer updates")
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    share_prompts: bool = Field(
        default=True,
        description="rows with the same prompt (a group) share one forward pass of it in the "
        "actor's and reference's log-prob passes and the critic's value passes; off: every row "
        "runs its prompt",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute activations in backward: less memory, ~30% more compute",
    )
    packing: bool = Field(
        default=True,
        description="padding-free forward passes: each micro-batch's rows run concatenated "
        "without their padding, attention kept inside each row (actor, reference, critic, reward "
        "model; SFT and DPO); where prompts are shared (train.share_prompts) the shared pass runs "
        "instead; off: padded rows",
    )
    balance_ranks: bool = Field(
        default=True,
        description="Ray data-parallel ranks get rows by their token lengths so that every rank "
        "computes about as many tokens (each keeping its row count; GRPO groups whole where "
        "prompts are shared); off: consecutive rows",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="micro-batches by a token budget: rows sorted by length, padding removed; "
        "null: micro_batch_size rows each",
    )
    logits_chunk_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] | None = Field(
        default="auto",
        description="the policy's and reference's log-prob passes run the LM head on this many "
        "tokens at a time and recompute each chunk's logits in the backward, never holding the "
        "[rows, tokens, vocabulary] logits (a large vocabulary's memory); auto: in chunks "
        "whose float32 logits stay under 64 MiB where a pass's would exceed 256 MiB, else "
        "all at once; null or 0: all at once",
    )


class EvalConfig(Section):
    """Held-out accuracy (greedy by default): before the first step, every `every` steps and
    after the last; `every: 0`: never. `at_start` / `at_end` force the evaluation before the
    first step / after the last one on or off (null: as `every` says)."""

    every: int = Field(
        default=10,
        ge=0,
        description="evaluate every N steps, at step 0 and after the last; 0: never",
    )
    at_start: bool | None = Field(
        default=None, description="evaluate before the first step (step 0); null: when every > 0"
    )
    at_end: bool | None = Field(
        default=None, description="evaluate after the last step; null: when every > 0"
    )
    temperature: float = Field(default=0.0, ge=0, description="0 means greedy")
    max_new_tokens: int | None = None
    batch_size: int = Field(default=256, ge=1)
    correct_threshold: float = Field(
        default=1.0, description="a response is correct if score ≥ this"
    )


class UploadEncryption(Section):
    """S3 server-side encryption of every object `checkpoint.upload_to` writes (the checkpoints
    and the exported policy): SSE-S3 (`AES256`) or SSE-KMS (`aws:kms` with the key's id)."""

    type: Literal["AES256", "aws:kms"] = Field(
        description="AES256: S3-managed keys (SSE-S3); aws:kms: a KMS key (SSE-KMS, kms_key_id)"
    )
    kms_key_id: str | None = Field(
        default=None,
        min_length=1,
        description="aws:kms: the KMS key's id, ARN or alias (required); not with AES256",
    )

    @model_validator(mode="after")
    def _key_matches_type(self) -> UploadEncryption:
        if self.type == "aws:kms" and self.kms_key_id is None:
            raise ValueError("kms_key_id: type aws:kms needs the KMS key's id (or ARN, alias)")
        if self.type == "AES256" and self.kms_key_id is not None:
            raise ValueError("kms_key_id: only with type aws:kms (AES256 uses S3's own keys)")
        return self


class CheckpointConfig(Section):
    """Checkpoints of the whole run state (weights, optimizer, scheduler, RNG, data position,
    controller and guard state, config) under RUN_DIR/checkpoints, published atomically."""

    save_steps: int = Field(
        default=50, ge=0, description="save every N steps and at the last; 0: none during the run"
    )
    keep: int = Field(
        default=2, ge=1, description="step folders to keep (the newest healthy one stays)"
    )
    upload_to: str | None = Field(
        default=None,
        description="fsspec URL (s3://bucket/prefix, file://…) to copy each checkpoint to",
    )
    storage_options: FiniteMapping = Field(
        default_factory=dict, description="fsspec options for upload_to (endpoint_url, key, …)"
    )
    upload_wait_s: float = Field(
        default=120.0, ge=0, description="at the end of the run, wait this long for pending uploads"
    )
    upload_encryption: UploadEncryption | None = Field(
        default=None,
        description="S3 server-side encryption of the uploads; null: the bucket's default",
    )
    format: Literal["full", "sharded"] = Field(
        default="full",
        description="full: rank 0 gathers and writes HF folders; sharded: every rank writes its "
        "own torch.distributed.checkpoint shards (resumable on another number of ranks)",
    )
    async_save: bool = Field(
        default=False,
        description="sharded only: stage each rank's shards in host memory and write them in "
        "the background while training goes on (published at the next save, rollback or exit)",
    )

    @model_validator(mode="after")
    def _async_needs_sharded(self) -> CheckpointConfig:
        if self.async_save and self.format != "sharded":
            raise ValueError("checkpoint.async_save needs checkpoint.format: sharded")
        return self

    @model_validator(mode="after")
    def _encryption_needs_s3(self) -> CheckpointConfig:
        if self.upload_encryption is not None and not (self.upload_to or "").startswith(
            ("s3://", "s3a://")
        ):
            raise ValueError(
                "checkpoint.upload_encryption is S3's server-side encryption: it needs "
                f"checkpoint.upload_to to be an s3:// URL (it is {self.upload_to!r})"
            )
        return self


GuardAction = Literal["warn", "rollback", "stop", "correct"]


GUARD_BOUNDS = ("max", "min", "max_drop", "max_drop_frac")
# The event names of rules on these metrics when a rule has no `name` (stable across releases:
# events.jsonl, alerts and dashboards read them).
GUARD_RULE_NAMES = {
    "actor/kl": "kl",
    "actor/entropy": "entropy",
    "response/length_mean": "length",
    "rollout/logprob_kl": "drift",
}


def _guard_bounds_set(rule: Mapping[str, Any] | BaseModel) -> list[str]:
    if isinstance(rule, BaseModel):
        return [b for b in GUARD_BOUNDS if getattr(rule, b) is not None]
    return [b for b in GUARD_BOUNDS if rule.get(b) is not None]


class GuardRule(Section):
    """One health rule: one metric, one bound, one action. `max`/`min` compare the step's value
    (or, with `window`, the rolling mean of the last `window` finite values); `max_drop` and
    `max_drop_frac` compare the rolling mean with its best so far (window 1 when unset)."""

    metric: str = Field(min_length=1, description="a key of metrics.jsonl (docs/metrics.md)")
    max: float | None = Field(default=None, description="trip when the value is above this")
    min: float | None = Field(default=None, description="trip when the value is below this")
    max_drop: float | None = Field(
        default=None, gt=0, description="trip when the rolling mean falls this far below its best"
    )
    max_drop_frac: float | None = Field(
        default=None, gt=0, description="trip when it falls this fraction of |best| below its best"
    )
    window: int | None = Field(
        default=None, ge=1, description="steps in the rolling mean; null: the step's own value"
    )
    action: GuardAction = Field(
        default="warn",
        description="warn; rollback (to the newest healthy checkpoint); stop; correct: switch "
        "the rollout correction to `preset` instead of rolling back",
    )
    preset: CorrectionPreset | None = Field(
        default=None,
        description="with action correct: the algorithm.rollout_correction preset the run "
        "switches to when the rule trips (e.g. decoupled_geo_rs_token_tis)",
    )
    name: str | None = Field(
        default=None,
        min_length=1,
        description="the rule's name in events.jsonl; null: collapse for a drop, kl / entropy / "
        "length / drift on their metrics, else the metric",
    )

    @model_validator(mode="after")
    def _one_bound(self) -> GuardRule:
        bounds = _guard_bounds_set(self)
        if len(bounds) != 1:
            raise ValueError(guard_bound_error(bounds))
        if (self.action == "correct") != (self.preset is not None):
            raise ValueError(
                "a guard rule's preset goes with action correct (the rollout-correction preset "
                f"it switches to); this rule has action {self.action} and preset {self.preset}"
            )
        return self

    @property
    def bound(self) -> str:
        """Which bound the rule sets: max, min, max_drop or max_drop_frac."""
        return _guard_bounds_set(self)[0]

    @property
    def rolling(self) -> bool:
        """The rule reads a rolling mean (a drop, or a window), not the step's own value."""
        return self.window is not None or self.bound in ("max_drop", "max_drop_frac")

    @property
    def label(self) -> str:
        """The rule's name in events (`name`, else its default)."""
        if self.name is not None:
            return self.name
        if self.bound in ("max_drop", "max_drop_frac"):
            return "collapse"
        if self.window is None and self.metric in GUARD_RULE_NAMES:
            return GUARD_RULE_NAMES[self.metric]
        return self.metric


def guard_bound_error(bounds: list[str], where: str = "a guard rule") -> str:
    got = f"it sets {' and '.join(bounds)}" if bounds else "it sets none"
    return f"{where} needs exactly one bound of {', '.join(GUARD_BOUNDS)}; {got}"


def _default_guard_rules() -> list[GuardRule]:
    return [GuardRule(metric="reward/mean", window=10, max_drop_frac=0.5, action="rollback")]


class NonfiniteConfig(Section):
    """A non-finite `*loss` or `*grad_norm`, or a skipped update (`*/skipped` > 0)."""

    action: Literal["warn", "skip"] = Field(
        default="skip", description="the update is skipped either way; warn or skip (count it)"
    )
    patience: int = Field(default=3, ge=1, description="non-finite steps in a row → rollback")


class GuardConfig(Section):
    """The circuit breaker: health rules checked after every step, each with an action."""

    enabled: bool = True
    rules: list[GuardRule] = Field(
        default_factory=_default_guard_rules,
        description="checked in order after every step; the default: a collapse of reward/mean "
        "(its 10-step rolling mean 50% below its best) rolls back",
    )
    nonfinite: NonfiniteConfig = NonfiniteConfig()

    @model_validator(mode="before")
    @classmethod
    def _bounds_by_index(cls, data: Any) -> Any:
        """A rule with no bound or several is an error naming guard.rules[i]."""
        rules = data.get("rules") if isinstance(data, dict) else None
        for i, rule in enumerate(rules if isinstance(rules, list) else []):
            if isinstance(rule, Mapping) and len(bounds := _guard_bounds_set(rule)) != 1:
                raise ValueError(guard_bound_error(bounds, f"guard.rules[{i}]"))
        return data

    lr_factor: float = Field(
        default=0.5, gt=0, le=1, description="LR multiplier after each rollback"
    )
    kl_factor: float = Field(
        default=1.0, ge=1, description="KL coefficient multiplier per rollback"
    )
    skip_data: bool = Field(
        default=True, description="after a rollback, skip the batches that led to it"
    )
    max_rollbacks: int = Field(
        default=3, ge=0, description="rollbacks allowed; one more trip stops"
    )


class PrometheusConfig(Section):
    """The Prometheus exporter: /metrics and /healthz over HTTP while the run lives."""

    host: str = Field(default="127.0.0.1", description="address to listen on; 0.0.0.0 for all")
    port: int = Field(default=9400, ge=0, le=65535, description="TCP port; 0 picks a free one")


class SamplesConfig(Section):
    """A few (prompt, response, reward) rows of the step's batch, to read what the policy says."""

    every: int = Field(default=10, ge=0, description="log samples every N steps; 0: never")
    count: int = Field(default=4, ge=1, description="rows logged each time")
    console: bool = Field(default=True, description="also print them on the console")


class WandbConfig(Section):
    """A W&B run per Keel run (its id kept in RUN_DIR/trackers.json, reopened on resume)."""

    project: str | None = Field(
        default=None, min_length=1, description="null: W&B's default project"
    )
    entity: str | None = Field(
        default=None, min_length=1, description="null: the account's default"
    )
    mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="null: online when W&B credentials are found (WANDB_API_KEY, "
        "WANDB_IDENTITY_TOKEN_FILE or a netrc entry), else offline under RUN_DIR/wandb",
    )
    tags: list[str] = Field(default_factory=list)
    group: str | None = Field(default=None, min_length=1)


class MlflowConfig(Section):
    """An MLflow run per Keel run (its id kept in RUN_DIR/trackers.json, reopened on resume)."""

    tracking_uri: str | None = Field(
        default=None,
        min_length=1,
        description="null: $MLFLOW_TRACKING_URI, else a file store at RUN_DIR/mlruns",
    )
    experiment: str = Field(default="keel", min_length=1, description="created when missing")
    log_model: bool = Field(default=False, description="log RUN_DIR/model as the artifact `model`")


class MonitorConfig(Section):
    """Where metrics go: console, metrics.jsonl, Prometheus, TensorBoard, W&B, MLflow."""

    progress: bool = Field(
        default=True, description="progress on stderr: a bar on a terminal, else lines (below)"
    )
    progress_every_steps: int = Field(
        default=10,
        ge=0,
        description="stderr not a terminal: a progress line every N steps (and after the "
        "first and the last step); 0: by time only",
    )
    progress_every_seconds: float = Field(
        default=60.0,
        ge=0,
        description="stderr not a terminal: a progress line after the first step that ends "
        "this many seconds after the previous line; 0: by steps only",
    )
    jsonl: bool = True
    prometheus: PrometheusConfig | None = Field(default=None, description="null: no exporter")
    tensorboard: bool = Field(default=False, description="write RUN_DIR/tensorboard event files")
    wandb: WandbConfig | None = Field(
        default=None, description="true or a section: log to W&B (needs `wandb`); false/null: off"
    )
    mlflow: MlflowConfig | None = Field(
        default=None,
        description="true or a section: log to MLflow (needs `mlflow`); false/null: off",
    )
    samples: SamplesConfig = SamplesConfig()

    @model_validator(mode="before")
    @classmethod
    def _tracker_switches(cls, data: Any) -> Any:
        """`wandb: true` / `mlflow: true` is the section with its defaults; false is off."""
        if isinstance(data, dict):
            data = dict(data)
            for key in ("wandb", "mlflow"):
                if data.get(key) is True:
                    data[key] = {}
                elif data.get(key) is False:
                    data[key] = None
        return data


RoleName = Literal["actor", "rollout", "reference", "critic", "reward"]


class WorkerGroupConfig(Section):
    """One colocation group: its roles share `workers` Ray actors (one placement-group bundle
    each). The actor with the rollout role in the same group generates with its own weights;
    a rollout role in another group gets the new weights pushed after each update."""

    roles: list[RoleName] = Field(min_length=1, description="roles hosted by these workers")
    workers: int = Field(default=1, ge=1, description="Ray actors (ranks) of the group")
    cpus_per_worker: float = Field(default=1.0, gt=0, description="CPUs reserved per worker")
    gpus_per_worker: float = Field(default=0.0, ge=0, description="GPUs per worker (nccl when > 0)")
    fsdp: bool = Field(default=False, description="shard the group's models with FSDP2 fully_shard")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="Ray placement-group strategy for the group's bundles"
    )
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="custom Ray resources each worker's bundle reserves, e.g. {node_b: 1} to "
        "place the group on the node started with `ray start --resources '{\"node_b\": 1}'`",
    )

    @model_validator(mode="after")
    def _custom_resources_only(self) -> WorkerGroupConfig:
        for name in ("CPU", "GPU"):
            if name in self.resources:
                field = "cpus_per_worker" if name == "CPU" else "gpus_per_worker"
                raise ValueError(f"resources.{name}: set {field} instead")
        return self


class RayConfig(Section):
    """How to reach Ray, and what the workers' processes get."""

    address: str | None = Field(
        default=None,
        description="an existing cluster (`auto`, `ray://…`, `HOST:6379`); null: start one",
    )
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs of a Ray started here")
    num_gpus: int | None = Field(default=None, ge=0, description="GPUs of a Ray started here")
    namespace: str = "keel"
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="environment of every worker (Ray runtime_env), e.g. NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME",
    )


class ResourcesConfig(Section):
    """Where the roles run: in this process (local) or as Ray actors (ray)."""

    backend: Literal["local", "ray"] = "local"
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="where models and batches live: auto is cuda when a GPU is visible",
    )
    ray: RayConfig = RayConfig()
    groups: list[WorkerGroupConfig] = Field(
        default_factory=lambda: [WorkerGroupConfig(roles=["actor", "rollout", "reference"])],
        description="colocation groups; roles in no group run in the driver process",
    )
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="ray: times a dead worker makes the run restart from a checkpoint",
    )
    weight_sync: Literal["auto", "collective", "object_store"] = Field(
        default="auto",
        description="how separate rollout workers get the actor's weights: auto is collective "
        "on Ray when the actor and the rollout are in separate groups, else object_store",
    )
    weight_sync_bucket_mb: float = Field(
        default=256.0, gt=0, description="collective weight sync: MiB per bucket of the byte stream"
    )

    @model_validator(mode="after")
    def _each_role_once(self) -> ResourcesConfig:
        seen: dict[str, int] = {}
        for i, group in enumerate(self.groups):
            for role in group.roles:
                if role in seen:
                    raise ValueError(
                        f"resources.groups[{i}].roles: role {role!r} is already in "
                        f"resources.groups[{seen[role]}]"
                    )
                seen[role] = i
        return self

    def group_of(self, role: str) -> WorkerGroupConfig | None:
        """The group hosting `role` (None: the role runs in the driver)."""
        return next((g for g in self.groups if role in g.roles), None)


class DistillationConfig(Section):
    """On-policy distillation (docs/algorithms.md "On-policy distillation"): a frozen teacher
    scores the student's own samples, and the actor's loss adds coef · L_distill (a per-token
    divergence to the teacher), or is L_distill alone without task rewards. RL only."""

    enabled: bool = False
    teacher: str | None = Field(
        default=None,
        description="the teacher: a model loaded in this process (a folder, builtin:NAME, hub "
        "id or GGUF file, resolved as models.actor), or the http(s) URL of a keel serve of it "
        "(its /v1/prompt_logprobs); it must share the student's tokenizer",
    )
    loss_mode: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk"] = (
        Field(
            default="k3",
            description="a single-sample reverse-KL estimator, or the top-k forward KL",
        )
    )
    topk: int = Field(default=32, ge=1, le=256, description="K of forward_kl_topk")
    use_task_rewards: bool = Field(
        default=True,
        description="keep the task's policy loss and add coef · L_distill; false: L_distill",
    )
    coef: float = Field(default=1.0, ge=0, description="weight of L_distill beside the task loss")
    loss_max_clamp: float | None = Field(
        default=None, gt=0, description="each token's loss clamped to [-M, M]; null: off"
    )
    log_prob_min_clamp: float | None = Field(
        default=None,
        lt=0,
        description="forward_kl_topk: log-probs clamped below at this; null: off",
    )
    use_policy_gradient: bool = Field(
        default=False,
        description="advantage -sg(loss) under PPO-clip (dual-clip 3) instead of the loss "
        "itself (supervised)",
    )
    clip_ratio_low: float = Field(
        default=0.2, ge=0, description="the policy-gradient mode's PPO clip"
    )
    clip_ratio_high: float = Field(
        default=0.2, ge=0, description="the policy-gradient mode's PPO clip"
    )

    @model_validator(mode="after")
    def _consistent(self) -> DistillationConfig:
        if not self.enabled:
            return self
        if self.teacher is None:
            raise ValueError(
                "distillation.enabled needs distillation.teacher (a model, or the URL of a "
                "keel serve of it)"
            )
        if self.loss_mode in ("kl", "k1") and not self.use_policy_gradient:
            raise ValueError(
                f"distillation.loss_mode {self.loss_mode} needs use_policy_gradient: true (the "
                "k1 estimator's gradient does not depend on the teacher); use k3 or k2 for the "
                "supervised mode"
            )
        if self.loss_mode == "forward_kl_topk" and self.use_policy_gradient:
            warnings.warn(
                "distillation.loss_mode forward_kl_topk with use_policy_gradient: the "
                "advantage -D scores the teacher's top-K distribution, not the sampled token",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def teacher_url(self) -> str | None:
        """The remote teacher's URL (distillation.teacher written as http(s)://...), else None."""
        t = self.teacher
        return t if t is not None and t.startswith(("http://", "https://")) else None


class KeelConfig(Section):
    """A whole run."""

    run_dir: str = "runs/keel"
    seed: Seed = 0
    models: ModelsConfig
    algorithm: Algorithm
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    monitor: MonitorConfig = MonitorConfig()
    resources: ResourcesConfig = ResourcesConfig()
    distillation: DistillationConfig = DistillationConfig()

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """Old keys (keel.config.legacy) in their new place, each reported once."""
        if not isinstance(data, dict):
            return data
        data, renamed = upgrade(data)
        warn_renamed(renamed)
        return data

    @model_validator(mode="after")
    def _batch_algebra(self) -> KeelConfig:
        check_batch_algebra(self)
        return self

    @model_validator(mode="after")
    def _lora_applies(self) -> KeelConfig:
        check_lora(self)
        return self

    @model_validator(mode="after")
    def _reward_fns_with_model(self) -> KeelConfig:
        if self.models.reward is not None and self.reward.fns and self.reward.model.fn_weight == 0:
            raise ValueError(
                "reward.fns is set, but with models.reward the functions count only with "
                "reward.model.fn_weight ≠ 0 (score = weight · RM + fn_weight · Σ weight_k · "
                "fn_k); set reward.model.fn_weight (e.g. 1.0) or remove reward.fns"
            )
        return self
