"""The mutation check: wrong math must make the tests fail.

Each mutation is one exact text replacement in Keel's source: a sign flipped, a ratio inverted,
a target swapped, a step skipped. `run_mutant` copies `src/keel` to a temporary folder, applies
the mutation there (the original tree is never touched), and runs the tests that must catch it
in a subprocess whose PYTHONPATH puts the mutated copy first: learning cases
(`caught_by`: test ids of tests/learning/test_learning.py::test_learns) and any other pytest
node ids (`tests`: unit tests of the behaviour). The mutant is *killed* when every one of those
tests fails; it *survived* when any of them passes. Any other outcome (a collection error, a
crash, a time-out) is reported as an error, not as a kill.

`make mutants` runs every mutation (`python -m tests.learning.mutants`); the suite runs a small
subset (tests/learning/test_mutants.py). docs/testing.md lists each mutation and its catcher.
A mutation whose text is no longer found exactly once fails loudly: update the table with the
code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
LEARNING = "tests/learning/test_learning.py::test_learns"
ENV_WARM_START = "KEEL_TEST_WARM_START"  # a warm-start policy folder the children reuse
ENV_CACHE = "KEEL_TEST_CACHE"  # a Keel cache (builtin models) the children reuse


@dataclass(frozen=True)
class Mutation:
    """Replace `old` (which must occur exactly once in src/keel/`path`) by `new`."""

    name: str
    path: str
    old: str
    new: str
    wrong: str  # the wrong math, in words
    caught_by: tuple[str, ...] = ()  # learning cases (test ids of test_learns) that must fail
    tests: tuple[str, ...] = ()  # other pytest node ids (path::test) that must fail

    def apply(self, src_root: Path) -> None:
        file = src_root / "keel" / self.path
        text = file.read_text(encoding="utf-8")
        count = text.count(self.old)
        if count != 1:
            raise MutationError(
                f"mutation {self.name}: {self.old!r} occurs {count} times in src/keel/"
                f"{self.path} (expected once); update tests/learning/mutants.py with the code"
            )
        file.write_text(text.replace(self.old, self.new), encoding="utf-8")

    def test_ids(self) -> list[str]:
        """The pytest node ids of every catcher: the learning cases first, then `tests`."""
        return [f"{LEARNING}[{case}]" for case in self.caught_by] + list(self.tests)

    def catchers(self) -> list[str]:
        """The catchers as `make mutants` prints them: a learning case by its name, a test by
        its node id."""
        return [*self.caught_by, *self.tests]


class MutationError(RuntimeError):
    """A mutation that cannot be applied to the current source."""


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in [
        Mutation(
            "advantage_sign",
            "workers/actor.py",
            "            trained.advantages,\n",
            "            -trained.advantages,\n",
            "the advantage's sign flipped in the actor's policy loss",
            ("grpo", "rloo", "ppo"),
        ),
        Mutation(
            "ratio_inverted",
            "algo/policy_loss.py",
            "ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))",
            "ratio = torch.exp(torch.clamp(-log_ratio, -20.0, 20.0))",
            "PPO-clip's importance ratio inverted: π_old/π_θ instead of π_θ/π_old",
            ("grpo",),
        ),
        Mutation(
            "gspo_ratio_inverted",
            "algo/policy_loss.py",
            "ratio = torch.exp(torch.clamp(log_seq, max=10.0))",
            "ratio = torch.exp(torch.clamp(-log_seq, max=10.0))",
            "GSPO's sequence importance ratio inverted",
            ("gspo",),
        ),
        Mutation(
            "kl_loss_sign",
            "workers/actor.py",
            "loss = loss + kl_coef * kl",
            "loss = loss - kl_coef * kl",
            "the KL loss term's sign flipped: the policy is pushed away from the reference",
            ("kl_loss",),
        ),
        Mutation(
            "kl_reward_sign",
            "algo/advantages.py",
            "torch.where(m, -kl_coef * kl.float(), zero)",
            "torch.where(m, kl_coef * kl.float(), zero)",
            "the KL penalty in the reward flipped into a KL bonus",
            ("kl_reward",),
        ),
        Mutation(
            "reward_ignored",
            "controller/rl.py",
            "rewards = token_level_rewards(scored.scores, mask, kl, beta)",
            "rewards = token_level_rewards(torch.zeros_like(scored.scores), mask, kl, beta)",
            "the reward ignored by training (a constant score; evaluation still scores)",
            ("grpo", "ppo"),
        ),
        Mutation(
            "value_target_swapped",
            "algo/value_loss.py",
            "ret = torch.where(m, returns, zero)",
            "ret = torch.where(m, old_values, zero)",
            "the value loss regresses on the old values instead of the returns",
            ("ppo_critic",),
        ),
        Mutation(
            "sft_sign",
            "algo/supervised.py",
            "agg_loss(-logprobs, response_mask",
            "agg_loss(logprobs, response_mask",
            "SFT maximises the NLL of the targets instead of minimising it",
            ("sft",),
        ),
        Mutation(
            "rm_pair_swapped",
            "algo/preference.py",
            "loss = -F.logsigmoid(diff).sum() / max(n, 1)",
            "loss = -F.logsigmoid(-diff).sum() / max(n, 1)",
            "the reward model's loss prefers the rejected response (its metrics stay right)",
            ("rm",),
        ),
        Mutation(
            "dpo_pair_swapped",
            "algo/preference.py",
            "h = chosen_logratio - rejected_logratio",
            "h = rejected_logratio - chosen_logratio",
            "DPO's margin taken the wrong way round (rejected over chosen)",
            ("dpo_sigmoid", "dpo_ipo"),
        ),
        # caught by unit tests of the behaviour (not by a learning case)
        Mutation(
            "entropy_bonus_sign",
            "workers/actor.py",
            "loss = pg.loss - spec.entropy_coeff * entropy_term",
            "loss = pg.loss + spec.entropy_coeff * entropy_term",
            "the entropy bonus's sign flipped: c_H > 0 lowers the entropy",
            tests=(
                "tests/workers/test_actor.py::"
                "test_the_entropy_bonus_raises_the_entropy_and_a_negative_one_lowers_it",
                "tests/workers/test_actor.py::"
                "test_the_logged_loss_is_pg_minus_the_entropy_bonus_plus_the_kl_term",
            ),
        ),
        Mutation(
            "grad_clip_off",
            "engine/update.py",
            "max_norm = self.grad_clip if self.grad_clip is not None else math.inf",
            "max_norm = math.inf",
            "gradient clipping disabled (the pre-clip norm is still logged)",
            tests=(
                "tests/engine/test_update.py::"
                "test_clipping_scales_the_update_to_grad_clip_and_logs_the_norm_before_it",
                "tests/engine/test_update.py::test_train_grad_clip_clips_the_built_actors_update",
            ),
        ),
        Mutation(
            "async_old_logprobs_from_engine",
            "controller/rl.py",
            "                batch = roles.actor.call(ActorWorker.compute_logprobs, batch)\n",
            "                batch = (\n"
            "                    batch.replace(old_logprobs=batch.rollout_logprobs)\n"
            "                    if self.max_staleness and batch.rollout_logprobs is not None\n"
            "                    else roles.actor.call(ActorWorker.compute_logprobs, batch)\n"
            "                )\n",
            "asynchronous rollout takes the engine's (stale) log-probs as π_old instead of the "
            "trainer's recomputation",
            tests=(
                "tests/controller/test_rl.py::"
                "test_asynchronous_pi_old_is_the_trainers_recomputation_not_the_engines",
            ),
        ),
        Mutation(
            "optimizer_state_not_restored",
            "workers/trainable.py",
            "        load_optimizer_state_dict("
            'self.model, self.step.optimizer, state["optimizer"])\n',
            "",
            "a checkpoint load keeps the fresh optimizer: AdamW's moments and step counts lost",
            tests=(
                "tests/checkpoint/test_state.py::test_a_checkpoint_restores_the_optimizer_state",
            ),
        ),
        Mutation(
            "is_weights_not_detached",
            "algo/correction.py",
            "    delta_source = logprobs.detach()\n",
            "    delta_source = logprobs\n",
            "rollout correction's bypass-mode IS weights not detached: the loss differentiates "
            "through w = min(π_θ/π_rollout, U) (REINFORCE's gradient is no longer −A·w)",
            tests=(
                "tests/algo/test_correction.py::"
                "test_bypass_reinforce_gradient_is_minus_a_times_the_detached_weight",
            ),
        ),
        Mutation(
            "rejection_after_advantages",
            "controller/rl.py",
            "            response_mask=kept,\n",
            "            response_mask=mask,\n",
            "rollout correction's rejection applied after the advantages: the estimator sees the "
            "sampled mask m, not m' = m ⊙ keep (rejected tokens in GRPO's advantages and in "
            "REINFORCE++'s whitening)",
            tests=(
                "tests/controller/test_rl.py::test_grpo_sees_the_rejection_before_its_advantages",
                "tests/controller/test_rl.py::"
                "test_reinforce_pp_baseline_whitens_over_the_kept_tokens_only",
            ),
        ),
        Mutation(
            "bypass_pi_old_from_trainer",
            "controller/rl.py",
            "                batch = batch.replace(old_logprobs=engine_logprobs(batch))\n",
            "                batch = roles.actor.call(ActorWorker.compute_logprobs, batch)\n",
            "rollout correction's bypass mode takes π_old from the trainer's recomputation "
            "instead of the engine's log-probs",
            tests=(
                "tests/controller/test_rl.py::"
                "test_bypass_ppo_clip_takes_the_engines_logprobs_as_pi_old_and_logs_from_the_loss",
                "tests/controller/test_rl.py::"
                "test_bypass_reinforce_takes_the_engines_logprobs_as_pi_old_and_logs_from_the_loss",
            ),
        ),
        Mutation(
            "interruptible_keeps_old_kv",
            "rollout/decode/rollout_loop.py",
            "                        self._reprefill(rows, tokens, steps)\n",
            "                        pass\n",
            "an interruptible rollout's rows continue under new weights over the KV cache the "
            "old ones computed: their tokens' log-probs are no version's",
            tests=(
                "tests/rollout/decode/test_rollout_loop.py::"
                "test_a_weight_swap_at_step_k_continues_the_rows_under_the_new_weights",
            ),
        ),
        Mutation(
            "interruptible_lag_by_newest_token",
            "controller/rl.py",
            "            version = oldest_version(batch.token_weight_versions, batch.response_mask,"
            " version)\n",
            "            version = int(batch.token_weight_versions.max())\n",
            "an interruptible rollout's batch is checked against max_staleness by its newest "
            "token instead of its oldest (a mixed row counts as fresh)",
            tests=(
                "tests/controller/test_pipeline.py::"
                "test_an_interruptible_ppo_run_with_critic_warmup_steps_runs_to_its_end",
            ),
        ),
        Mutation(
            "teacher_logprobs_shifted",
            "workers/teacher.py",
            "        at = index[i, p + cols]  # their compacted positions j\n",
            "        at = index[i, p + cols] - 1  # their compacted positions j\n",
            "the distillation teacher's log-probs read one position early: each response token "
            "gets the teacher's log-prob of the token before it",
            tests=(
                "tests/workers/test_teacher.py::"
                "test_teacher_logprobs_are_the_models_next_token_logprobs_at_the_response_positions",
                "tests/workers/test_teacher.py::"
                "test_teacher_topk_are_the_models_most_likely_next_tokens",
            ),
        ),
        Mutation(
            "distillation_reverse_kl_sign",
            "algo/distillation.py",
            "        per_token = estimator_loss(safe_student, safe_teacher, opts.loss_mode)\n",
            "        per_token = -estimator_loss(safe_student, safe_teacher, opts.loss_mode)\n",
            "on-policy distillation's reverse-KL estimate with its sign flipped: the student is "
            "pushed away from the teacher (supervised), or rewarded for the divergence (policy "
            "gradient)",
            tests=(
                "tests/algo/test_distillation.py::"
                "test_supervised_mode_lowers_the_reverse_kl_to_the_teacher",
                "tests/algo/test_distillation.py::"
                "test_policy_gradient_mode_pushes_tokens_the_teacher_likes_more_up",
            ),
        ),
        Mutation(
            "kl_against_itself",
            "algo/kl.py",
            "value = _BASE[base](logprobs, ref_logprobs)",
            "value = _BASE[base](logprobs, logprobs)",
            "the KL estimated between the policy and itself (the reference ignored): the KL and "
            "its gradient are 0 from the first step (the learning harness must report a KL "
            "that starts at 0 as a failure, not crash)",
            ("kl_loss", "kl_reward"),
        ),
    ]
}


@dataclass
class MutantResult:
    mutation: Mutation
    status: str  # killed (every test failed) | survived (a test passed) | error
    returncode: int
    seconds: float
    output: str
    failed: int = 0
    passed: int = 0


def run_mutant(
    mutation: Mutation,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    tests: list[str] | None = None,
) -> MutantResult:
    """Apply `mutation` to a copy of src/ and run its catching tests against that copy."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"keel-mutant-{mutation.name}-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(SRC / "keel", src / "keel", ignore=shutil.ignore_patterns("__pycache__"))
        mutation.apply(src)
        child_env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        tests = tests or mutation.test_ids()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout
        )
    failed, passed = _count(proc.stdout, "failed"), _count(proc.stdout, "passed")
    errors = _count(proc.stdout, "errors?")
    if proc.returncode == 1 and failed == len(tests) and not errors:
        status = "killed"
    elif proc.returncode in (0, 1) and passed:
        status = "survived"
    else:
        status = "error"
    seconds = time.perf_counter() - start
    return MutantResult(
        mutation, status, proc.returncode, seconds, proc.stdout + proc.stderr, failed, passed
    )


def _count(pytest_output: str, word: str) -> int:
    """N of pytest's closing 'N failed, M passed in …' line (0 when absent)."""
    lines = pytest_output.strip().splitlines()
    found = re.findall(rf"(\d+) {word}\b", lines[-1] if lines else "")
    return int(found[-1]) if found else 0


def main(argv: list[str] | None = None) -> int:
    """Run mutations (all by default); exit 1 unless every one is killed. Prints one line per
    mutation (status, name, time, how many of its catchers failed, the wrong math), then its
    catchers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"mutations (default all: {', '.join(MUTATIONS)})")
    args = parser.parse_args(argv)
    names = args.names or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {', '.join(MUTATIONS)}")
    # the warm start only when a learning case is among the catchers
    learning = any(MUTATIONS[n].caught_by for n in names)
    env = prepare_shared_fixtures() if learning else {}
    bad = 0
    for name in names:
        result = run_mutant(MUTATIONS[name], env=env)
        bad += result.status != "killed"
        catchers = result.mutation.catchers()
        print(f"{result.status:8s} {name:30s} {result.seconds:6.1f}s  {result.failed} of "
              f"{len(catchers)} failed: {result.mutation.wrong}", flush=True)  # fmt: skip
        for catcher in catchers:
            print(f"{'':9s}caught by {catcher}", flush=True)
        if result.status != "killed":
            print(result.output[-3000:])
    print(f"{len(names) - bad} of {len(names)} mutants killed")
    return 1 if bad else 0


def prepare_shared_fixtures() -> dict[str, str]:
    """Build the warm start once, from the unmutated code, for every child to reuse: a mutant
    is judged by the learning cases, not by how it would have built their starting point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from tests.learning.cases import CASES, run_case

    root = Path(tempfile.mkdtemp(prefix="keel-mutants-"))
    os.environ.setdefault("KEEL_CACHE", str(root / "cache"))
    outcome = run_case(CASES["sft"], root / "sft", warm=None)
    return {ENV_WARM_START: str(outcome.model_dir), ENV_CACHE: os.environ["KEEL_CACHE"]}


if __name__ == "__main__":
    sys.exit(main())
