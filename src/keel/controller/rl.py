"""The RL step: sample → reward (→ dynamic sampling, shaping) → old/ref log-probs → the
teacher's (distillation) → values → per-token rewards and advantages → critic and actor
updates. Algorithm-blind: everything algorithm-specific comes from the AlgorithmSpec."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from keel.algo import (
    ADVANTAGE_ESTIMATORS,
    build_kl_controller,
    kl_penalty,
    masked_explained_variance,
    masked_mean,
    overlong_penalty,
    token_level_rewards,
)
from keel.algo.advantages import group_statistics, last_valid_index
from keel.algo.correction import decoupled_correction
from keel.algo.drift import logprob_drift
from keel.algo.kl import batch_mean_kl
from keel.controller.assembly import Datasets, Roles
from keel.controller.evaluation import evaluate_policy
from keel.controller.pipeline import RolloutGate, RolloutPipeline, version_metrics
from keel.controller.protocol import Controller
from keel.controller.sampling import DynamicSampler, FlatGroupsWatch
from keel.data import BatchStream
from keel.envs.builtin import sandbox_warnings
from keel.envs.episodes import drop_failed_groups, episode_metrics, failure_warning
from keel.monitor import StageTimer
from keel.plan.run import ResolvedRun
from keel.recipes.correction import with_correction_preset
from keel.rollout import SamplingParams
from keel.types import (
    AdvantageBatch,
    Batch,
    BatchMeta,
    GroupedBatch,
    LogprobBatch,
    ReferenceBatch,
    ScoredBatch,
    SequenceBatch,
    TokenBatch,
    VersionedBatch,
)
from keel.workers.actor import ActorWorker
from keel.workers.critic import CriticWorker
from keel.workers.reference import ReferenceWorker
from keel.workers.roles import RewardRole, TeacherRole
from keel.workers.rollout import RolloutWorker, oldest_version


class RLController(Controller):
    skips_batches = True  # the batches generated ahead, then the prompt stream's

    def __init__(self, run: ResolvedRun, roles: Roles[ActorWorker], data: Datasets):
        cfg, spec = run.config, run.spec
        self.cfg = cfg
        self.spec = spec
        self.roles = roles
        self.eval_examples = data.eval
        self.prompts = BatchStream(
            data.train, cfg.train.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed
        )
        r = cfg.rollout
        self.sampling = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens
        )
        self.timer = StageTimer()
        self.groups_seen = 0
        self.kl_ctrl = build_kl_controller(**spec.kl_ctrl) if spec.kl_penalty else None
        self.sampler = (
            DynamicSampler(cfg.train.batch_size, spec.max_num_gen_batches)
            if spec.dynamic_sampling
            else None
        )
        self.rollouts = RolloutPipeline(
            self.produce,
            r.max_staleness,
            gate=RolloutGate(roles.rollout, r.swap_step()) if r.interruptible else None,
        )
        # most groups all-equal for several steps: a warning (dynamic sampling has its own)
        # (none either where the task reward is not trained on: distillation alone)
        task_reward = spec.distillation is None or spec.distillation.use_task_rewards
        self.flat_groups = (
            FlatGroupsWatch(r.n) if task_reward and not spec.dynamic_sampling else None
        )
        self.max_staleness = r.max_staleness
        self.last_batch: Batch | None = None
        # (rule, message), emitted by the run loop; first: the environment's (a python tool
        # whose sandbox has only its inner layers here)
        self.warnings: list[tuple[str, str]] = (
            []
            if r.env is None
            else sandbox_warnings(
                r.env.name, r.env.kwargs, require_bubblewrap=r.env.require_bubblewrap
            )
        )
        self._warnings_lock = threading.Lock()
        self.weight_version = 0  # actor updates so far: the version every rollout must carry
        self.kl_coef = spec.kl_loss_coef  # the KL-loss coefficient (β of KL in the reward: kl_ctrl)
        self.kl_scale = 1.0  # the guard raises it after a rollback; scales both
        # On-policy shortcut: with one epoch over one mini-batch the actor updates the very
        # policy that generated the batch, so π_old is the current policy's own log-probs,
        # detached in the loss (as verl and TRL do): no separate old-log-prob forward. Not
        # when something reads old_logprobs before the update (KL in the reward, the rollout
        # drift metric).
        self.mini_batch_rows = run.batch.mini_batch_size
        self.on_policy_shortcut = (
            spec.ppo_epochs == 1 and self.kl_ctrl is None and not r.return_logprobs
        )
        self.correction_preset: str | None = None  # the guard's switch (set_rollout_correction)

    # ------------------------------------------------------- guard actions
    def skip_batches(self, n: int) -> None:
        """Skip `n` batches without training on them: those generated ahead first, then the
        prompt stream's next ones."""
        for _ in range(n - self.rollouts.drop(n)):
            self.prompts.next_batch()

    def set_kl_scale(self, scale: float) -> None:
        """Multiply the KL coefficients (the loss's, and β of KL in the reward) by `scale`
        relative to their unguarded values."""
        self.kl_scale = scale

    @property
    def bypass(self) -> bool:
        """Rollout correction's bypass mode: π_old := the engine's log-probs, no recomputation."""
        correction = self.spec.rollout_correction
        return correction is not None and correction.bypass

    def set_rollout_correction(self, preset: str) -> str | None:
        """Switch the rollout correction to `preset` (the guard's `correct` action; the next
        step's batch is corrected with it, and its update uses it); returns its description,
        or None when the run already has it or has no rollout correction to switch."""
        if self.spec.rollout_correction is None or self.correction_preset == preset:
            return None
        self.spec = with_correction_preset(self.spec, preset)
        self.correction_preset = preset
        correction = self.spec.rollout_correction
        assert correction is not None
        return correction.describe()

    def warn(self, rule: str, message: str) -> None:
        """Keep a warning for the run loop (events.jsonl); from any thread (the rollout
        pipeline's scores batches ahead)."""
        with self._warnings_lock:
            self.warnings.append((rule, message))

    def pop_warnings(self) -> list[tuple[str, str]]:
        """(rule, message) of the warnings raised since the last call (events.jsonl): the
        environment's, dynamic sampling's and the reward scorer's."""
        with self._warnings_lock:
            out, self.warnings = self.warnings, []
        return out

    def evaluate(self) -> dict[str, float]:
        """eval/* metrics of the policy on the held-out examples ({} without eval data)."""
        self.rollouts.drain()  # an interruptible rollout's last job may still be generating
        return evaluate_policy(self.roles, self.eval_examples, self.cfg, self.warn)

    def step(self, step: int) -> dict[str, float]:
        """One RL step; returns its metrics."""
        start = time.perf_counter()
        roles, t, spec = self.roles, self.timer, self.spec
        batch, extra = self.rollouts.next(remaining=self.cfg.train.steps - step)
        self.check_weight_version(batch)
        if self.sampler is not None and (message := self.sampler.short_warning(step, extra)):
            self.warn("dynamic_sampling", message)
        batch, shaping = self.shape_rewards(batch)
        with t("old_logprobs"):  # ≈ 0 s under the on-policy shortcut and in bypass mode
            if self.bypass:
                batch = batch.replace(old_logprobs=engine_logprobs(batch))
            elif not (self.on_policy_shortcut and len(batch) <= self.mini_batch_rows):
                batch = roles.actor.call(ActorWorker.compute_logprobs, batch)
        if roles.reference is not None:
            with t("ref_logprobs"):
                batch = roles.reference.call(ReferenceWorker.compute_ref_logprobs, batch)
        if roles.teacher is not None:  # on-policy distillation: the teacher scores the tokens
            with t("teacher_logprobs"):
                batch = roles.teacher.call(TeacherRole.compute_teacher_logprobs, batch)
        if roles.critic is not None:
            with t("values"):
                batch = roles.critic.call(CriticWorker.compute_values, batch)
        sampled = batch.response_mask  # before rollout correction's rejection
        with t("advantage"):
            batch, kl_metrics = self.compute_advantages(batch)
        # the sampled tokens' statistics (m, not m'); no drift in bypass mode, where π_old is
        # the engine's own (the loss measures the gap: rollout_corr/*)
        measured = batch.replace(response_mask=sampled)
        drift = not self.bypass
        metrics = {**batch_metrics(measured, drift=drift), **extra, **shaping, **kl_metrics}
        metrics["rollout/weight_version_lag"] = float(batch.meta.get("weight_version_lag", 0))
        if self.cfg.rollout.interruptible:  # rows generated across a weight push
            versioned = batch.view(VersionedBatch)
            metrics.update(
                version_metrics(versioned.token_weight_versions, versioned.response_mask)
            )
        if self.flat_groups is not None and (
            flat := self.flat_groups.check(
                step, metrics["reward/all_equal_frac"], metrics["reward/mean"]
            )
        ):
            self.warn("flat_groups", flat)
        if spec.overlong_filter:  # overlong filtering: after the advantages, loss mask only
            batch, metrics["response/truncated_masked"] = mask_truncated(batch)
        if roles.critic is not None:
            with t("critic_update"):
                metrics.update(roles.critic.call(CriticWorker.update, batch, spec=spec))
        if step > spec.critic_warmup_steps:
            with t("update"):
                metrics.update(
                    roles.actor.call(
                        ActorWorker.update, batch, spec=spec, kl_coef=self.kl_coef * self.kl_scale
                    )
                )
            self.weight_version += 1
            metrics.update(self.rollouts.push(roles.push_weights))
        elapsed = time.perf_counter() - start
        self.last_batch = batch  # read by the samples log (keel.monitor.samples)
        tokens = batch.view(TokenBatch).attention_mask.sum()
        return {
            **metrics,
            **self.timer.pop(),
            "actor/kl_coef": self.kl_coef * self.kl_scale,
            "timing/step_s": elapsed,
            "perf/tokens_per_second": float(tokens) / elapsed,
        }

    def produce(self) -> tuple[Batch, dict[str, float]]:
        """The batch of one step and its sampling/timing metrics: one generation round, or
        dynamic sampling's rounds. On the pipeline's thread when rollout.max_staleness ≥ 1
        (its own StageTimer: the step's runs concurrently)."""
        timer = StageTimer()
        failures: dict[str, float] = {}  # episode/failed, … summed over the rounds
        if self.sampler is None:
            batch, extra = self.generate(timer, failures), {}
        else:
            batch, extra = self.sampler.sample(lambda: self.generate(timer, failures))
        return batch, {**extra, **failures, **timer.pop()}

    def generate(self, timer: StageTimer, failures: dict[str, float] | None = None) -> Batch:
        """The next train.batch_size prompts, rollout.n responses each, scored. With
        rollout.env, the groups holding an episode that failed on every attempt are dropped
        first (keel.envs.episodes.drop_failed_groups), their counts added to `failures`."""
        examples = self.prompts.next_batch()
        rollout, reward = self.roles.rollout, self.roles.reward
        assert rollout is not None and reward is not None, "RL needs the rollout and reward roles"
        with timer("rollout"):
            batch = rollout.call(
                RolloutWorker.generate,
                examples,
                sampling=self.sampling,
                group_offset=self.groups_seen,
            )
        self.groups_seen += len(examples)
        if (message := failure_warning(batch)) is not None:  # before their rows are dropped
            self.warn("episode_failures", message)
        batch, counts = drop_failed_groups(batch)
        for key, value in counts.items():
            if failures is not None:
                failures[key] = failures.get(key, 0.0) + value
        with timer("reward"):
            batch = reward.call(RewardRole.score, batch)
        for rule, message in batch.meta.pop("reward_warnings", ()):
            self.warn(rule, message)
        return batch

    def check_weight_version(self, batch: Batch) -> None:
        """The rollout must have used weights at most rollout.max_staleness updates old (0:
        those of the latest update). A larger lag means the rollout workers missed a weight
        push, and training on the batch would be more off-policy than configured. A row
        generated across a push (rollout.interruptible) counts by its oldest token: the lag
        is that of the oldest token of the batch (token_weight_versions)."""
        version = batch.meta.get("weight_version", self.weight_version)
        if batch.token_weight_versions is not None and batch.response_mask is not None:
            version = oldest_version(batch.token_weight_versions, batch.response_mask, version)
        lag = self.weight_version - version
        batch.meta["weight_version_lag"] = lag
        if not 0 <= lag <= self.max_staleness:
            raise RuntimeError(
                f"the rollout generated with weight version {version}, expected "
                f"{self.weight_version} (rollout.max_staleness {self.max_staleness} allows "
                f"{max(0, self.weight_version - self.max_staleness)} to {self.weight_version}): "
                "the rollout workers missed a weight push"
            )

    def shape_rewards(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Soft overlong punishment added to the scores (when spec.overlong_buffer_len > 0)."""
        if not self.spec.overlong_buffer_len:
            return batch, {}
        scored = batch.view(ScoredBatch)
        penalty = overlong_penalty(
            scored.response_mask.sum(dim=1),  # the policy's tokens (an episode's: every turn's)
            max_length=self.cfg.rollout.response_budget(),
            buffer_length=self.spec.overlong_buffer_len,
            penalty_factor=self.spec.overlong_penalty_factor,
        )
        shaped = batch.replace(scores=scored.scores + penalty)
        return shaped, {"reward/overlong_penalty_mean": penalty.mean().item()}

    def compute_advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Token rewards (score on the last valid token, −β·k with KL in the reward), then the
        rollout correction's decoupled stage (`correct_rollout`: the IS weights stored on the
        batch, the response mask narrowed to m' = m ⊙ keep), then the spec's advantage
        estimator on m' (each row's score still the one summed under m). β is read before the
        KL controller's update."""
        scored, metrics = batch.view(ScoredBatch), {}
        mask, groups = scored.response_mask, batch.view(GroupedBatch).group_ids
        assert self.spec.advantage is not None, f"{self.spec.name!r} has no advantage estimator"
        kl, beta = None, 0.0
        if self.kl_ctrl is not None:  # built when spec.kl_penalty is set
            old = batch.view(LogprobBatch).old_logprobs
            ref = batch.view(ReferenceBatch).ref_logprobs
            assert self.spec.kl_penalty is not None
            kl = kl_penalty(old, ref, self.spec.kl_penalty)
            beta, current = self.kl_ctrl.value * self.kl_scale, batch_mean_kl(kl, mask)
            self.kl_ctrl.update(current, n_steps=len(batch))
            metrics = {"kl_ctrl/coef": beta, "kl_ctrl/reward_kl": current}
        rewards = token_level_rewards(scored.scores, mask, kl, beta)
        batch, corrected = self.correct_rollout(batch)
        metrics.update(corrected)
        kept = batch.view(ScoredBatch).response_mask  # m' = m ⊙ keep (m without a rejection)
        estimator = ADVANTAGE_ESTIMATORS[self.spec.advantage]
        advantages, returns = estimator(
            token_rewards=rewards,
            response_mask=kept,
            score_mask=mask,
            group_ids=groups,
            values=batch.values,
            **self.spec.advantage_kwargs,
        )
        if returns is not None:
            metrics["advantage/returns_mean"] = masked_mean(returns, mask).item()
        return batch.replace(advantages=advantages, returns=returns), metrics

    def correct_rollout(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Rollout correction, decoupled mode (keel.algo.correction.decoupled_correction), once
        per step after KL-in-reward and before the advantages: δ = ℓ_old − ℓ_roll gives the IS
        weights (stored on the batch as rollout_is_weights: detached, the same for every epoch
        and mini-batch) and the rejection (response_mask ← m ⊙ keep), and the rollout_corr/*
        and training/* metrics. Without a correction, and in bypass mode (the loss corrects),
        the batch is unchanged."""
        settings = self.spec.rollout_correction
        if settings is None or settings.bypass:
            return batch, {}
        out = decoupled_correction(
            batch.view(LogprobBatch).old_logprobs,
            engine_logprobs(batch),
            batch.view(ScoredBatch).response_mask,
            settings,
        )
        batch = batch.replace(response_mask=out.response_mask, rollout_is_weights=out.weights)
        return batch, {key: value.item() for key, value in out.metrics.items()}

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state (C1): data position, group counter, KL coefficients (the
        loss's, the guard's scale, the reward KL controller), dynamic-sampling counters. Role
        weights live in the workers' state_dicts."""
        return {
            "prompts": self.prompts.state_dict(),
            "groups_seen": self.groups_seen,
            "weight_version": self.weight_version,
            "kl_coef": self.kl_coef,
            "kl_scale": self.kl_scale,
            "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rollouts_ahead": self.rollouts.state_dict(),
            "rollout_rng": self._rollout_rng(),
            "rollout_correction": self.correction_preset,
        }

    def _rollout_rng(self) -> list[dict[str, Any]] | None:
        """Each rank's random state, for rollout workers in processes of their own (Ray);
        None in this process, whose random state the checkpoint holds anyway."""
        group = self.roles.rollout
        assert group is not None
        return None if group.in_process else group.call_all(RolloutWorker.rng_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.groups_seen = int(state["groups_seen"])
        self.weight_version = int(state.get("weight_version", 0))
        self.kl_coef = float(state["kl_coef"])
        self.kl_scale = float(state["kl_scale"])
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        self.rollouts.load_state_dict(state.get("rollouts_ahead", []))
        if state.get("rollout_correction"):  # switched by the guard before this checkpoint
            self.set_rollout_correction(state["rollout_correction"])
        states, rollout = state.get("rollout_rng"), self.roles.rollout
        assert rollout is not None
        # resumed on another number of rollout ranks: each keeps its own seed's stream
        if states is not None and not rollout.in_process and len(states) == rollout.world_size:
            rollout.call(RolloutWorker.load_rng_state, states)


def batch_eos_ids(meta: BatchMeta) -> list[int]:
    """The EOS ids a batch was generated with: meta["eos_token_ids"] (a list, set by the rollout
    engine), else the single meta["eos_token_id"] of older producers, else none."""
    ids = meta.get("eos_token_ids")
    if ids is None:
        one = meta.get("eos_token_id")
        ids = [] if one is None else [one]
    return [int(i) for i in ids]


def truncated_rows(batch: Batch) -> torch.Tensor:
    """[B] bool: rows whose last valid token is none of the EOS ids (cut at the length budget;
    an episode: its last turn was)."""
    eos = batch_eos_ids(batch.meta)
    if not eos:
        return torch.zeros(len(batch), dtype=torch.bool)
    rollout = batch.view(SequenceBatch)
    last_index = last_valid_index(rollout.response_mask)  # the policy's last token (holes: an
    last = rollout.input_ids[:, -batch.response_length :].gather(  # episode's last turn)
        1, last_index.clamp(min=0)[:, None]
    )
    return ~torch.isin(last.squeeze(1), torch.tensor(eos, dtype=last.dtype, device=last.device))


def mask_truncated(batch: Batch) -> tuple[Batch, float]:
    """Overlong filtering: truncated rows get response mask 0; (batch, fraction masked)."""
    cut = truncated_rows(batch)
    mask = torch.where(cut[:, None], torch.zeros(()), batch.view(SequenceBatch).response_mask)
    return batch.replace(response_mask=mask), cut.float().mean().item()


def engine_logprobs(batch: Batch) -> torch.Tensor:
    """The rollout engine's log-probs of the batch [B, R], which rollout correction needs."""
    if batch.rollout_logprobs is None:
        raise ValueError(
            "algorithm.rollout_correction needs the rollout engine's log-probs, and the batch "
            "has none: the engine returned no log-probs (rollout.return_logprobs)"
        )
    return batch.rollout_logprobs


def batch_metrics(batch: Batch, drift: bool = True) -> dict[str, float]:
    """reward/*, response/*, advantage and rollout-drift diagnostics of one step's batch (the
    drift with `drift` and both log-probs in the batch)."""
    scored = batch.view(ScoredBatch)
    scores, mask = scored.scores, scored.response_mask
    advantages = batch.view(AdvantageBatch).advantages
    lengths = mask.sum(dim=1)
    truncated = truncated_rows(batch).float()
    _, group_std, group_size = group_statistics(scores, batch.view(GroupedBatch).group_ids)
    all_equal = ((group_std == 0) & (group_size > 1)).float()
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std(unbiased=False).item(),
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "reward/errors": float(batch.meta.get("reward_errors", 0)),
        "reward/all_equal_frac": all_equal.mean().item(),
        **batch.meta.get("reward_metrics", {}),  # e.g. reward/model_* from a reward model
        "response/length_mean": lengths.float().mean().item(),
        "response/length_max": lengths.max().item(),
        "response/clip_ratio": truncated.mean().item(),
        "advantage/mean": masked_mean(advantages, mask).item(),
        "advantage/abs_mean": masked_mean(advantages.abs(), mask).item(),
    }
    if batch.values is not None and batch.returns is not None:  # how well V_old predicted
        ev = masked_explained_variance(batch.values, batch.returns, mask)  # the fresh returns
        metrics["critic/vf_explained_var"] = ev.item()
    if batch.episodes is not None:
        metrics.update(episode_metrics(batch.episodes))
    if drift and batch.rollout_logprobs is not None and batch.old_logprobs is not None:
        metrics.update(drift_metrics(batch.rollout_logprobs, batch.old_logprobs, mask))
    return metrics


def drift_metrics(
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """rollout/logprob_* (engine vs trainer, keel.algo.drift) on the response tokens of mask."""
    drift = logprob_drift(rollout_logprobs, old_logprobs, mask)
    metrics = {
        "rollout/logprob_abs_diff": drift.abs_diff_mean,
        "rollout/logprob_abs_diff_max": drift.abs_diff_max,
        "rollout/logprob_kl": drift.kl_k3,
        "rollout/logprob_kl_k1": drift.kl_k1,
    }
    return {k: v.item() for k, v in metrics.items()}
