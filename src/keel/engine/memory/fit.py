"""A run's memory per GPU, and the setting to change when it does not fit.

`plan_inputs(cfg, shapes, …)` reads what matters from a validated `KeelConfig` into plain
`PlanInputs`; `plan_memory(inputs)` is pure: one `GPUPlan` per placement (a rank of each
colocation group), each with its roles' pieces (`RoleMemory`) and its peak; `advise(inputs)`
tries the levers (gradient checkpointing, logits_chunk_tokens, a smaller micro-batch, LoRA,
more GPUs with FSDP) and returns each with the peak after it.

The peak of a placement is its resident memory (every role's weights, the trained roles'
gradients, which Keel keeps from one update to the next, and AdamW's moments) plus the largest
of its phases, which run one after another on that GPU: an update (gradients freed at its
start, then max(gradients, activations + logits)), a generate call (KV cache), a no-grad
log-prob pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from keel.engine.logits_budget import LogitsChunk
from keel.engine.memory.estimate import (
    DTYPE_BYTES,
    FP32,
    activation_bytes,
    generation_work_bytes,
    kv_cache_bytes,
    logits_bytes,
    model_state_bytes,
    no_grad_work_bytes,
)
from keel.engine.memory.shapes import Head, ModelShape

if TYPE_CHECKING:
    from keel.config import KeelConfig

TRAINED = ("actor", "critic")
ROLES = ("actor", "critic", "reference", "reward", "rollout")  # the order plans list them
GiB = 1 << 30
MiB = 1 << 20

# What a device holds besides the planned tensors, a constant per GPU or per CPU process
# (docs/memory.md, "What the device itself takes"):
# - a GPU: the CUDA context torch creates (the driver's state, the loaded kernels, cuBLAS's
#   workspace), about 500 MiB per GPU on recent GPUs and CUDA 12;
# - a CPU process: the interpreter and the libraries `keel train` imports (torch, transformers,
#   peft, keel: 362-369 MiB measured) with the tokenizer, the data, the thread pools and the
#   kernels' buffers: 512 MiB, the resident set of `keel train` once SmolLM2-135M's weights are
#   loaded (1025 MiB) less those weights (513 MiB).
CUDA_CONTEXT = 500 * MiB
CPU_PROCESS = 512 * MiB
Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class RoleInput:
    """One role's model. shape None: a role with no model (a reward function)."""

    role: str
    model: str
    shape: ModelShape | None
    trained: bool = False
    head: Head = "lm"
    shares_actor: bool = False  # a reference that is the actor's own module (LoRA, adapter off)


@dataclass(frozen=True)
class GroupInput:
    """A colocation group: its roles share each of its `workers` GPUs (one rank per GPU)."""

    name: str
    roles: tuple[str, ...]
    workers: int = 1
    fsdp: bool = False


@dataclass(frozen=True)
class PlanInputs:
    """What the planner reads from a config (every count per step, not per rank)."""

    roles: Mapping[str, RoleInput]
    groups: tuple[GroupInput, ...]
    dtype: str = "float32"
    pure_low_precision: bool = False
    lora: tuple[int, Any] | None = None  # (r, target_modules)
    mini_batch_size: int = 1
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    prompt_tokens: int = 64
    response_tokens: int = 16
    gradient_checkpointing: bool = False
    logits_chunk_tokens: LogitsChunk = None  # "auto": resolved per pass (logits_bytes)
    eager_attention: bool = False
    generate_prompts: int = 1  # prompts per generate call (rollout.batch_size)
    rollout_n: int = 1
    share_prompts: bool = False  # train.share_prompts in an RL stage: a group's prompt runs once
    rollout_engine: str = "hf"
    vllm_memory_fraction: float = 0.5
    rollout_copy: bool = False
    gpu_memory: int = 80 * GiB
    backend: str = "local"
    device: Device = "cuda"
    runtime: int = 0  # bytes each GPU or process holds besides tensors (CUDA_CONTEXT, CPU_PROCESS)
    notes: tuple[str, ...] = field(default=())

    @property
    def generate_rows(self) -> int:
        """Sequences of one generate call: prompts × rollout.n."""
        return self.generate_prompts * self.rollout_n

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def trained_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype] if self.pure_low_precision else FP32


@dataclass(frozen=True)
class RoleMemory:
    """One role's bytes on one GPU. activations: with the config's checkpointing setting;
    activations_off / activations_on: without and with gradient checkpointing."""

    role: str
    model: str
    parameters: int
    trained_parameters: int
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    activations_off: int = 0
    activations_on: int = 0
    logits: int = 0
    kv_cache: int = 0
    work: int = 0  # a no-grad pass's or a generate call's working set besides the above
    reserved: int = 0  # vLLM: gpu_memory_utilization × the GPU's memory (its weights, KV cache)

    @property
    def resident(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reserved


@dataclass(frozen=True)
class GPUPlan:
    """One GPU (a rank of a group) or CPU process: its roles, their resident bytes, each
    phase's peak (tensors only), and `runtime`: what the device holds besides tensors (the CUDA
    context; a CPU process's interpreter and libraries), counted in `peak`."""

    group: str
    workers: int
    fsdp: bool
    roles: tuple[RoleMemory, ...]
    phases: Mapping[str, int]
    runtime: int = 0

    @property
    def resident(self) -> int:
        return sum(r.resident for r in self.roles)

    @property
    def peak(self) -> int:
        return self.runtime + max([self.resident, *self.phases.values()])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else "resident"


@dataclass(frozen=True)
class MemoryPlan:
    """Every placement of a run and whether each fits `gpu_memory` bytes."""

    gpus: tuple[GPUPlan, ...]
    gpu_memory: int

    @property
    def peak(self) -> int:
        return max((g.peak for g in self.gpus), default=0)

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory


@dataclass(frozen=True)
class Advice:
    """A change of settings (the `--set` keys and values) and the run's peak after it."""

    settings: tuple[str, ...]
    peak: int
    fits: bool


def _rows_per_rank(inputs: PlanInputs, workers: int) -> tuple[int, int]:
    """(rows, tokens per row) of one rank's micro-batch (keel.config.derived.rank_batch_sizes)."""
    seq = inputs.prompt_tokens + inputs.response_tokens
    mini = max(inputs.mini_batch_size // workers, 1)
    rows = min(inputs.micro_batch_size, mini)
    if inputs.max_tokens_per_micro_batch is not None:
        rows = max(min(rows, inputs.max_tokens_per_micro_batch // seq), 1)
    return rows, seq


def _role_memory(inputs: PlanInputs, role: RoleInput, group: GroupInput) -> RoleMemory:
    shape = role.shape
    if shape is None or role.shares_actor:
        return RoleMemory(role=role.role, model=role.model, parameters=0, trained_parameters=0)
    shards = group.workers if group.fsdp else 1
    b = inputs.compute_bytes
    head = role.head
    params = shape.parameters(head)
    rows, seq = _rows_per_rank(inputs, group.workers)
    if role.trained:
        trained = params
        if role.role == "actor" and inputs.lora is not None:
            trained = shape.lora_parameters(inputs.lora[0], inputs.lora[1])
            states = model_state_bytes(
                trained,
                params,
                trained_bytes=inputs.trained_bytes,
                frozen_bytes=inputs.trained_bytes,
                shards=shards,
            )
        else:
            states = model_state_bytes(
                trained, 0, trained_bytes=inputs.trained_bytes, frozen_bytes=b, shards=shards
            )
        shared = inputs.share_prompts and inputs.rollout_n > 1 and head == "lm"
        acts = {
            on: activation_bytes(
                shape,
                rows=rows,
                seq_len=seq,
                compute_bytes=b,
                checkpointing=on,
                eager_attention=inputs.eager_attention,
                prompt_rows=-(-rows // inputs.rollout_n) if shared else None,
                prompt_len=inputs.prompt_tokens,
            )
            for on in (False, True)
        }
        logits = 0
        if head == "lm":
            chunk = inputs.logits_chunk_tokens
            logits = logits_bytes(
                rows=rows,
                tokens=inputs.response_tokens,
                vocab=shape.vocab_size,
                compute_bytes=b,
                chunk_tokens=chunk,
            )
        layer = shape.layer_parameters(shape.moe_layers > 0)
        copies = {on: _weight_copies(inputs, group, params, trained, layer, on) for on in acts}
        return RoleMemory(
            role=role.role,
            model=role.model,
            parameters=params,
            trained_parameters=trained,
            weights=states.weights,
            gradients=states.gradients,
            optimizer=states.optimizer,
            activations=acts[inputs.gradient_checkpointing] + copies[inputs.gradient_checkpointing],
            activations_off=acts[False] + copies[False],
            activations_on=acts[True] + copies[True],
            logits=logits,
        )
    weights = model_state_bytes(0, params, trained_bytes=b, frozen_bytes=b, shards=shards).weights
    if role.role == "rollout":
        gen_rows = max(-(-inputs.generate_rows // group.workers), 1)
        kv = kv_cache_bytes(shape, rows=gen_rows, tokens=seq, compute_bytes=b)
        work = generation_work_bytes(
            shape, rows=gen_rows, prompt=inputs.prompt_tokens, compute_bytes=b
        )
        if inputs.rollout_engine == "vllm":  # its weights and cache are in what it reserves
            reserved = int(inputs.vllm_memory_fraction * inputs.gpu_memory)
            return RoleMemory(role="rollout", model=role.model, parameters=params,
                              trained_parameters=0, reserved=reserved)  # fmt: skip
        if not inputs.rollout_copy:
            weights = 0  # generates with the actor's own module
        return RoleMemory(
            role="rollout",
            model=role.model,
            parameters=params if weights else 0,
            trained_parameters=0,
            weights=weights,
            kv_cache=kv,
            work=work,
        )
    work = no_grad_work_bytes(shape, rows=rows, seq_len=seq, compute_bytes=b)
    logits = _no_grad_logits(shape, inputs, rows) if head == "lm" else 0
    return RoleMemory(
        role=role.role,
        model=role.model,
        parameters=params,
        trained_parameters=0,
        weights=weights,
        logits=logits,
        work=work,
    )


def _weight_copies(
    inputs: PlanInputs, group: GroupInput, params: int, trained: int, layer: int, ckpt: bool
) -> int:
    """Bytes of a trained model's weights in the compute dtype during its update: under FSDP2
    the two layers being all-gathered (one computing, one prefetched); under autocast (mixed
    precision) its copy of every weight: it caches the copy of each weight that has a gradient
    until the forward ends, and the graph keeps the copies of the others (a LoRA base) unless
    each layer is recomputed (`ckpt`); none in full precision."""
    b = inputs.compute_bytes
    if group.fsdp and group.workers > 1:
        return 2 * layer * b
    if b >= inputs.trained_bytes:
        return 0
    if trained < params and ckpt:
        return (trained + layer) * b
    return params * b


def _no_grad_pass(shape: ModelShape | None, inputs: PlanInputs, group: GroupInput) -> int:
    """The actor's own no-grad log-prob pass (old log-probs, evaluation)."""
    if shape is None:
        return 0
    rows, seq = _rows_per_rank(inputs, group.workers)
    work = no_grad_work_bytes(shape, rows=rows, seq_len=seq, compute_bytes=inputs.compute_bytes)
    return work + _no_grad_logits(shape, inputs, rows)


def _no_grad_logits(shape: ModelShape, inputs: PlanInputs, rows: int) -> int:
    """Bytes of the response logits of a no-grad log-prob pass over `rows` rows."""
    return logits_bytes(
        rows=rows,
        tokens=inputs.response_tokens,
        vocab=shape.vocab_size,
        compute_bytes=inputs.compute_bytes,
        chunk_tokens=inputs.logits_chunk_tokens,
        training=False,
    )


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """One `GPUPlan` per group (every rank of a group holds the same), and the verdict."""
    gpus = []
    for group in inputs.groups:
        roles = tuple(
            _role_memory(inputs, inputs.roles[name], group)
            for name in group.roles
            if name in inputs.roles
        )
        resident = sum(r.resident for r in roles)
        phases: dict[str, int] = {}
        for r in roles:
            if r.role in TRAINED and r.trained_parameters:
                phases[f"{r.role} update"] = (
                    resident - r.gradients + max(r.gradients, r.activations + r.logits)
                )
            elif r.role == "rollout":
                if inputs.rollout_engine != "vllm":  # vLLM's reservation is resident
                    phases["rollout generate"] = resident + r.kv_cache + r.work
            elif r.weights:
                phases[f"{r.role} forward"] = resident + r.logits + r.work
        actor = inputs.roles.get("actor")
        if actor is not None and "actor" in group.roles and actor.shape is not None:
            phases["actor log-probs"] = resident + _no_grad_pass(actor.shape, inputs, group)
        # none where nothing is held (the driver's reward function), nor for vLLM alone, whose
        # gpu_memory_utilization share holds its own context
        holds = [r for r in roles if r.resident or r.kv_cache or r.activations]
        alone = bool(holds) and all(r.reserved for r in holds)
        gpus.append(
            GPUPlan(
                group=group.name,
                workers=group.workers,
                fsdp=group.fsdp,
                roles=roles,
                phases=phases,
                runtime=inputs.runtime if holds and not alone else 0,
            )
        )
    return MemoryPlan(gpus=tuple(gpus), gpu_memory=inputs.gpu_memory)


def _actor_group(inputs: PlanInputs) -> int:
    return next((i for i, g in enumerate(inputs.groups) if "actor" in g.roles), 0)


def advise(inputs: PlanInputs) -> list[Advice]:
    """The levers, each alone, then together, with the peak after each; [] when it fits.
    Tried: gradient checkpointing, logits_chunk_tokens, halving
    the micro-batch (down to 1 row), halving rollout.batch_size (the KV cache), LoRA (r 16,
    all-linear) on the actor, and FSDP in the actor's group over its GPUs or more (2, 4, …
    512: the fewest that fit)."""
    if plan_memory(inputs).fits:
        return []
    out: list[Advice] = []
    levers: list[tuple[tuple[str, ...], PlanInputs]] = []
    if not inputs.gradient_checkpointing:
        levers.append(
            (("train.gradient_checkpointing=true",), replace(inputs, gradient_checkpointing=True))
        )
    if inputs.logits_chunk_tokens in (None, 0):
        levers.append(
            (("train.logits_chunk_tokens=1024",), replace(inputs, logits_chunk_tokens=1024))
        )
    micro = inputs.micro_batch_size
    best = None
    while micro > 1:
        micro //= 2
        candidate = replace(inputs, micro_batch_size=micro, max_tokens_per_micro_batch=None)
        best = ((f"train.micro_batch_size={micro}",), candidate)
        if plan_memory(candidate).fits:
            break
    if best is not None:
        levers.append(best)
    prompts, best = inputs.generate_prompts, None
    while "rollout" in inputs.roles and inputs.rollout_engine == "hf" and prompts > 1:
        prompts //= 2
        candidate = replace(inputs, generate_prompts=prompts)
        best = ((f"rollout.batch_size={prompts}",), candidate)
        if plan_memory(candidate).fits:
            break
    if best is not None:
        levers.append(best)
    if inputs.lora is None and "actor" in inputs.roles and inputs.roles["actor"].trained:
        levers.append((("models.lora.r=16",), _with_lora(inputs, 16)))
    for settings, candidate in levers:
        plan = plan_memory(candidate)
        out.append(Advice(settings, plan.peak, plan.fits))
    together = inputs
    settings_all: list[str] = []
    for settings, candidate in levers:
        together = _merge(together, candidate)
        settings_all.extend(settings)
    if len(levers) > 1:
        plan = plan_memory(together)
        out.append(Advice(tuple(settings_all), plan.peak, plan.fits))
    if inputs.device == "cpu":  # more processes on one machine share its memory
        return out
    i = _actor_group(inputs)
    now = inputs.groups[i]
    for n in (now.workers, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        if n < now.workers or (n == now.workers and (now.fsdp or n == 1)):
            continue
        groups = list(inputs.groups)
        groups[i] = replace(groups[i], workers=n, fsdp=True)
        candidate = replace(inputs, groups=tuple(groups), logits_chunk_tokens=None)
        plan = plan_memory(candidate)
        if plan.fits or n == 512:
            ray = ("resources.backend=ray",) if inputs.backend == "local" else ()
            sets = (f"resources.groups[{i}].workers={n}", f"resources.groups[{i}].fsdp=true")
            out.append(Advice(ray + sets, plan.peak, plan.fits))
            break
    return out


def _with_lora(inputs: PlanInputs, r: int) -> PlanInputs:
    """inputs with a LoRA adapter of rank r on every linear layer of the actor; a reference of
    the actor's own model becomes the actor's module with the adapter off (no weights)."""
    roles = dict(inputs.roles)
    ref, actor = roles.get("reference"), roles["actor"]
    if ref is not None and ref.model == actor.model:
        roles["reference"] = replace(ref, shares_actor=True)
    return replace(inputs, lora=(r, "all-linear"), roles=roles)


def _merge(base: PlanInputs, changed: PlanInputs) -> PlanInputs:
    """base with every field that `changed` sets differently from its own defaults applied."""
    updates: dict[str, Any] = {}
    for name in ("gradient_checkpointing", "logits_chunk_tokens", "lora", "roles"):
        if getattr(changed, name) != getattr(base, name) and getattr(changed, name):
            updates[name] = getattr(changed, name)
    if changed.generate_prompts < base.generate_prompts:
        updates["generate_prompts"] = changed.generate_prompts
    if changed.micro_batch_size < base.micro_batch_size:
        updates["micro_batch_size"] = changed.micro_batch_size
        updates["max_tokens_per_micro_batch"] = None
    return replace(base, **updates)


def plan_inputs(
    cfg: KeelConfig,
    roles: frozenset[str] | set[str],
    shapes: Mapping[str, ModelShape | None],
    *,
    gpus: int | None = None,
    gpu_memory: int = 80 * GiB,
    device: Device = "cuda",
) -> PlanInputs:
    """The planner's inputs from a validated `KeelConfig`. roles: the algorithm's roles
    (`AlgorithmSpec.roles`); shapes: each role's model shape (None: no model, e.g. a reward
    function). gpus: ranks of the actor's group (each one GPU; default: the config's workers;
    with the local backend all roles share one process, planned as one group of `gpus`).
    device: cuda (each GPU also holds CUDA_CONTEXT) or cpu (each process: CPU_PROCESS, and the
    memory is the machine's)."""
    from keel.config import batch_plan
    from keel.config.derived import OFFLINE, PAIR_STAGES

    m, t, r = cfg.models, cfg.train, cfg.rollout
    plan = batch_plan(cfg)
    name = cfg.algorithm.name
    per_item = 2 if name in PAIR_STAGES else 1  # a preference pair is two rows
    role_inputs: dict[str, RoleInput] = {}
    for role in (x for x in ROLES if x in roles):
        model = {
            "actor": m.actor,
            "rollout": m.actor,
            "reference": m.reference or m.actor,
            "critic": m.critic or m.actor,
            "reward": m.reward,
        }.get(role)
        shape = shapes.get(role)
        if role == "reward" and m.reward is None:
            shape = None
        heads: dict[str, Head] = {
            "critic": "value",
            "reward": "score",
            "actor": "score" if name == "rm" else "lm",
        }
        role_inputs[role] = RoleInput(
            role=role,
            model=str(model) if model is not None else (cfg.reward.fn or "reward function"),
            shape=shape,
            trained=role in TRAINED,
            head=heads.get(role, "lm"),
            shares_actor=role == "reference"
            and m.lora is not None
            and (m.reference is None or m.reference == m.actor),
        )
    notes: list[str] = []
    if name in OFFLINE:
        notes.append(
            f"{name} trains on the data's responses, which no setting bounds: planned with "
            f"rollout.max_new_tokens ({r.max_new_tokens}) response tokens per row; set it to "
            "the data's longest response (--set rollout.max_new_tokens=N)"
        )
    if cfg.resources.backend == "local":
        groups = (
            GroupInput(
                "local", tuple(x for x in ROLES if x in roles), workers=gpus or 1, fsdp=False
            ),
        )
        if gpus and gpus > 1:
            notes.append(
                f"--gpus {gpus} with resources.backend local: planned as one Ray group of "
                f"{gpus} data-parallel workers holding every role"
            )
    else:
        groups_list = []
        placed: set[str] = set()
        for i, g in enumerate(cfg.resources.groups):
            names = tuple(x for x in g.roles if x in roles)
            placed.update(names)
            workers = g.workers
            if gpus is not None and "actor" in names:
                workers = gpus
            if names:
                groups_list.append(GroupInput(f"groups[{i}]", names, workers=workers, fsdp=g.fsdp))
        rest = tuple(sorted(set(roles) - placed))
        if rest:
            groups_list.append(GroupInput("driver", rest))
        groups = tuple(groups_list)
    actor_group = next((g for g in groups if "actor" in g.roles), None)
    rollout_copy = (
        r.engine == "vllm"
        or r.max_staleness > 0
        or actor_group is None
        or "rollout" not in actor_group.roles
    )
    shared = [
        f"groups[{i}]" for i, g in enumerate(cfg.resources.groups) if 0 < g.gpus_per_worker < 1
    ]
    if cfg.resources.backend == "ray" and shared:
        notes.append(
            f"{', '.join(shared)}: gpus_per_worker below 1, so a GPU may hold ranks of several "
            "groups: add their peaks"
        )
    if m.attn_implementation == "eager":
        notes.append("models.attn_implementation eager: attention scores counted (s² per head)")
    return PlanInputs(
        roles=role_inputs,
        groups=groups,
        dtype=m.dtype,
        pure_low_precision=m.pure_low_precision,
        lora=(m.lora.r, m.lora.target_modules) if m.lora is not None else None,
        mini_batch_size=plan.mini_batch_size * per_item,
        micro_batch_size=plan.micro_batch_size * per_item,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        prompt_tokens=cfg.data.max_prompt_length,
        response_tokens=r.response_budget(),
        gradient_checkpointing=t.gradient_checkpointing,
        logits_chunk_tokens=t.logits_chunk_tokens,
        eager_attention=m.attn_implementation == "eager",
        generate_prompts=r.batch_size or t.batch_size,
        rollout_n=r.n,
        share_prompts=t.share_prompts and name not in OFFLINE,
        rollout_engine=r.engine,
        vllm_memory_fraction=r.vllm.gpu_memory_utilization,
        rollout_copy=rollout_copy,
        gpu_memory=gpu_memory,
        backend=cfg.resources.backend,
        device=device,
        runtime=CUDA_CONTEXT if device == "cuda" else CPU_PROCESS,
        notes=tuple(notes),
    )
