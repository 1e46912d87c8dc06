"""The RL step for the new algorithms: PPO's critic warm-up and adaptive KL in the reward, DAPO's
overlong shaping and filtering, and the controller's own state (C1)."""

import math
from pathlib import Path

import pytest
import torch

from keel.config import validate
from keel.controller.assembly import build_reward, load_datasets, local_roles
from keel.controller.rl import (
    RLController,
    batch_eos_ids,
    batch_metrics,
    drift_metrics,
    mask_truncated,
    truncated_rows,
)
from keel.plan.run import resolve_run
from keel.recipes import build_spec
from keel.types import Batch
from keel.workers.actor import ActorWorker
from keel.workers.reference import ReferenceWorker


def controller(tiny_dir, algorithm, **sections):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": algorithm,
        "data": {"arithmetic": {"eval_size": 4}},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "train": {"batch_size": 4, "lr": 1e-3, "steps": 4}, **sections,
    })  # fmt: skip
    run = resolve_run(cfg, build_spec(cfg))
    roles = local_roles(run.workers, build_reward(cfg))
    return RLController(run, roles, load_datasets(cfg, run.spec))


def params(group):
    return [p.detach().clone() for p in group.workers[0].model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


ADAPTIVE = {"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.01, "horizon": 10}
PPO = {"name": "ppo", "critic_warmup_steps": 1, "critic_lr": 1e-3, "kl_ctrl": ADAPTIVE}


def test_ppo_trains_only_the_critic_during_warm_up_then_both(tiny_dir):
    ctl = controller(tiny_dir, PPO)
    actor0, critic0 = params(ctl.roles.actor), params(ctl.roles.critic)
    m1 = ctl.step(1)
    assert same(params(ctl.roles.actor), actor0) and not same(params(ctl.roles.critic), critic0)
    assert "critic/vf_loss" in m1 and "actor/pg_loss" not in m1
    assert m1["kl_ctrl/coef"] == 0.1
    m2 = ctl.step(2)
    assert not same(params(ctl.roles.actor), actor0)
    assert "actor/pg_loss" in m2 and "critic/vf_clipfrac" in m2


def test_adaptive_kl_follows_the_reward_kl_and_the_state_round_trips(tiny_dir, tmp_path):
    ctl = controller(tiny_dir, PPO)
    for step in (1, 2, 3):
        metrics = ctl.step(step)
    # β is read before the update: β_next = β·(1 + clip(KL/target − 1, ±0.2)·B/horizon)
    error = max(min(metrics["kl_ctrl/reward_kl"] / 0.01 - 1, 0.2), -0.2)
    assert ctl.kl_ctrl.value == pytest.approx(metrics["kl_ctrl/coef"] * (1 + error * 8 / 10))
    state = ctl.state_dict()
    fresh = controller(tiny_dir, PPO)
    fresh.load_state_dict(state)
    assert fresh.kl_ctrl.value == ctl.kl_ctrl.value and fresh.groups_seen == 12
    assert fresh.prompts.next_batch() == ctl.prompts.next_batch()
    torch.save(state, tmp_path / "state.pt")  # plain values and tensors


def test_dapo_shapes_long_responses_and_logs_dynamic_sampling(tiny_dir):
    ctl = controller(tiny_dir, {"name": "dapo", "overlong_buffer_len": 2, "overlong_filter": True,
                                "max_num_gen_batches": 2})  # fmt: skip
    metrics = ctl.step(1)
    assert metrics["sampling/gen_rounds"] in (1.0, 2.0)
    assert (
        "reward/overlong_penalty_mean" in metrics and metrics["reward/overlong_penalty_mean"] <= 0
    )
    assert 0.0 <= metrics["response/truncated_masked"] <= 1.0
    assert ctl.state_dict()["sampler"]["rounds"] == metrics["sampling/gen_rounds"]


def test_truncated_rows_lose_their_loss_mask_only():
    eos = 2
    # one prompt column, three response columns: row 0 and row 2 end in EOS, row 1 is cut.
    ids = torch.tensor([[5, 7, eos, 0], [5, 7, 8, 9], [5, eos, 0, 0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                  meta={"eos_token_ids": [eos]})  # fmt: skip
    assert truncated_rows(batch).tolist() == [False, True, False]
    out, frac = mask_truncated(batch)
    assert out.response_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert frac == pytest.approx(1 / 3)


def test_a_row_ending_on_any_eos_id_is_not_truncated():
    # EOS ids 2 and 3: row 0 ends on 2, row 1 on 3, row 2 is cut, row 3 has 3 inside but is cut.
    ids = torch.tensor([[5, 7, 2, 0], [5, 7, 3, 0], [5, 7, 8, 9], [5, 3, 8, 9]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                  meta={"eos_token_ids": [2, 3]})  # fmt: skip
    assert truncated_rows(batch).tolist() == [False, False, True, True]
    full = batch.replace(scores=torch.zeros(4), group_ids=torch.arange(4),
                         advantages=torch.zeros(4, 3))  # fmt: skip
    assert batch_metrics(full)["response/clip_ratio"] == 0.5
    # a batch from an older producer names one id; without any, no row counts as truncated
    legacy = batch.replace(meta={"eos_token_id": 3})
    assert truncated_rows(legacy).tolist() == [True, False, True, True]
    assert batch_eos_ids({}) == [] and not truncated_rows(batch.replace(meta={})).any()


def test_a_ppo_run_writes_the_critic_as_an_hf_folder_next_to_the_policy(tiny_dir, tmp_path):
    from keel.controller import run_training
    from keel.models import load_value_model

    cfg = validate({
        "run_dir": str(tmp_path / "run"), "models": {"actor": str(tiny_dir)},
        "algorithm": {"name": "ppo", "critic_lr": 1e-3}, "data": {"arithmetic": {"eval_size": 4}},
        "rollout": {"n": 2, "max_new_tokens": 4}, "train": {"batch_size": 2, "steps": 1},
        "monitor": {"progress": False},
    })  # fmt: skip
    result = run_training(cfg)
    critic = load_value_model(result.run_dir / "critic")
    assert critic.config.num_labels == 1
    assert (result.run_dir / "critic" / "tokenizer.json").is_file()


def test_a_separate_rollout_that_missed_a_weight_push_stops_the_run(tiny_dir):
    """The rollout role as a separate worker (its own model copy): with the push every step
    passes the version check; without it the second step's rollout is one update behind."""
    from keel.plan.inputs import worker_inputs
    from keel.workers.build import build_workers
    from keel.workers.group import LocalWorkerGroup, WeightPush

    ctl = controller(tiny_dir, {"name": "grpo", "kl_loss_coef": 0.0})
    separate = build_workers(worker_inputs(ctl.cfg, ctl.spec), ["rollout"], None)["rollout"]
    assert separate.weights_from is None
    ctl.roles.rollout = LocalWorkerGroup("rollout", [separate])
    ctl.roles.push_weights = WeightPush(ctl.roles.actor, ctl.roles.rollout)
    for step in (1, 2):
        metrics = ctl.step(step)
        assert metrics["rollout/weight_version_lag"] == 0
        assert metrics["rollout/weight_version"] == step
    assert same(params(ctl.roles.actor), list(separate.engine.model.parameters()))
    ctl.roles.push_weights = lambda: {}  # a push that never arrives
    ctl.step(3)
    with pytest.raises(RuntimeError, match="weight version 2, expected 3"):
        ctl.step(4)


def test_a_trl_style_reward_scores_the_rollouts_through_the_config(tiny_dir):
    from pathlib import Path

    from tests.cli.format_reward import digit_fraction

    fn = f"{Path(__file__).parents[1] / 'cli/format_reward.py'}:digit_fraction_trl"
    ctl = controller(tiny_dir, {"name": "grpo"}, reward={"fn": fn, "signature": "trl"})
    metrics = ctl.step(1)
    batch = ctl.last_batch
    expected = [digit_fraction(None, r, None) for r in batch.responses]
    assert batch.scores.tolist() == pytest.approx(expected)
    assert metrics["reward/mean"] == pytest.approx(sum(expected) / len(expected))


@pytest.mark.parametrize("algorithm", [{"name": "grpo", "kl_loss_coef": 0.05}, {"name": "gspo"}])
def test_the_on_policy_shortcut_gives_the_same_steps_as_recomputing_old_logprobs(
    tiny_dir, algorithm
):
    """One epoch over one mini-batch: π_old = the current policy detached (no old-log-prob
    forward) gives the same weights and metrics as the recomputed π_old, step after step."""
    runs = []
    for shortcut in (True, False):
        torch.manual_seed(0)
        ctl = controller(tiny_dir, algorithm)
        assert ctl.on_policy_shortcut  # this config qualifies
        ctl.on_policy_shortcut = shortcut
        metrics = [ctl.step(step) for step in (1, 2, 3)]
        runs.append((params(ctl.roles.actor), metrics))
    (w_fast, m_fast), (w_full, m_full) = runs
    for a, b in zip(w_fast, w_full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for fast, full in zip(m_fast, m_full, strict=True):
        for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "reward/mean"):
            assert fast[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
        assert fast["actor/ppo_kl"] == 0.0 and fast["actor/clipfrac"] == 0.0


def test_no_shortcut_where_old_logprobs_are_read_before_the_update(tiny_dir):
    """Several mini-batches or epochs, KL in the reward, or the drift metric: π_old is
    recomputed."""
    assert not controller(tiny_dir, {"name": "grpo"}, train={
        "batch_size": 4, "lr": 1e-3, "steps": 4, "ppo_epochs": 2}).on_policy_shortcut  # fmt: skip
    assert not controller(tiny_dir, PPO).on_policy_shortcut
    ctl = controller(tiny_dir, {"name": "grpo"}, rollout={
        "n": 2, "max_new_tokens": 4, "return_logprobs": True})  # fmt: skip
    assert not ctl.on_policy_shortcut
    metrics = ctl.step(1)
    assert {"rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/logprob_kl",
            "rollout/logprob_kl_k1"} <= metrics.keys()  # fmt: skip
    assert not any(k.startswith("rollout/tis_") for k in metrics)  # no cap, no TIS diagnostics
    two_minis = controller(tiny_dir, {"name": "grpo"}, train={
        "batch_size": 4, "mini_batch_size": 4, "lr": 1e-3, "steps": 4})  # fmt: skip
    seen = []
    two_minis.roles.actor.call = _spy(two_minis.roles.actor.call, seen)
    two_minis.step(1)
    assert ActorWorker.compute_logprobs in seen


def test_token_tis_steps_log_the_drift_and_the_weights(tiny_dir):
    """The old rollout.tis_cap is the decoupled_token_is preset; the step logs its metrics next
    to the drift. The colocated HF engine samples with the trainer's own weights, so the drift
    is ≈ 0 and the weights ≈ 1 (none capped)."""
    with pytest.warns(FutureWarning, match="rollout.tis_cap"):
        ctl = controller(tiny_dir, {"name": "grpo"}, rollout={
            "n": 2, "max_new_tokens": 4, "return_logprobs": True, "tis_cap": 2.0})  # fmt: skip
    corr = ctl.spec.rollout_correction
    assert corr.preset == "decoupled_token_is" and corr.is_threshold.upper == 2.0
    assert not ctl.on_policy_shortcut
    before = params(ctl.roles.actor)
    metrics = ctl.step(1)
    assert not same(before, params(ctl.roles.actor))
    assert metrics["rollout/logprob_kl"] < 1e-4 and metrics["rollout/logprob_abs_diff_max"] < 1e-2
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert ctl.last_batch.rollout_is_weights is not None


def test_drift_metrics_of_a_batch_by_hand():
    """r = π_old/π_rollout = [1, 3] on the response tokens, garbage in the masked one."""
    rollout = torch.tensor([[-1.0, -2.0, float("nan")]])
    old = rollout + torch.tensor([[0.0, math.log(3), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    metrics = drift_metrics(rollout, old, mask)
    assert metrics == pytest.approx({
        "rollout/logprob_abs_diff": math.log(3) / 2,
        "rollout/logprob_abs_diff_max": math.log(3),
        "rollout/logprob_kl": (2 - math.log(3)) / 2,
        "rollout/logprob_kl_k1": -math.log(3) / 2,
    })  # fmt: skip


def _spy(call, seen):
    def wrapped(method, *args, **kwargs):
        seen.append(method)
        return call(method, *args, **kwargs)

    return wrapped


def test_lora_grpo_trains_only_the_adapter_against_the_base_as_reference(tiny_dir):
    """models.lora: the reference is the actor's module with the adapter off (no second model),
    equal to the base model before and after updates; only adapter weights move; a separate
    rollout gets merged plain weights that compute what the actor's LoRA model computes."""
    from pathlib import Path

    from keel.engine.forward import response_forward
    from keel.models import load_causal_lm
    from keel.models.lora import is_lora
    from keel.plan.inputs import worker_inputs
    from keel.workers.build import build_workers
    from keel.workers.group import LocalWorkerGroup, WeightPush

    lora = {"actor": str(tiny_dir), "lora": {"r": 4, "alpha": 8.0}}
    graded = {"fn": f"{Path(__file__).parents[1] / 'cli/format_reward.py'}:digit_fraction"}
    ctl = controller(tiny_dir, {"name": "grpo", "kl_loss_coef": 0.05}, models=lora, reward=graded)
    actor = ctl.roles.actor.workers[0]
    assert is_lora(actor.model) and ctl.roles.reference.workers[0].model is actor.model
    assert all(".lora_" in n for n, p in actor.model.named_parameters() if p.requires_grad)
    separate = build_workers(worker_inputs(ctl.cfg, ctl.spec), ["rollout"], None)["rollout"]
    assert not is_lora(separate.engine.model)
    ctl.roles.rollout = LocalWorkerGroup("rollout", [separate])
    ctl.roles.push_weights = WeightPush(ctl.roles.actor, ctl.roles.rollout)
    base = load_causal_lm(tiny_dir).eval()
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters()}

    def logps(model, batch):
        with torch.no_grad():
            return response_forward(model.eval(), batch)[0]

    # The reference (peft with the adapter off, in the worker's micro-batches) and a plain
    # load on the whole batch are two code paths: equal up to float rounding, which differs
    # from one CPU to another (here 1 ulp: 9.5e-7 at log-probs below -8), so rtol 1e-5.
    for step in (1, 2):
        metrics = ctl.step(step)
        assert metrics["rollout/weight_version_lag"] == 0
        batch = ctl.last_batch  # its ref_logprobs were computed before this step's update
        torch.testing.assert_close(batch.ref_logprobs, logps(base, batch), atol=1e-6, rtol=1e-5)
    for name, p in actor.model.named_parameters():
        assert torch.equal(p, frozen[name]) != p.requires_grad, name  # adapter moved, base not
    ref = ctl.roles.reference.call(ReferenceWorker.compute_ref_logprobs, batch).ref_logprobs
    torch.testing.assert_close(ref, logps(base, batch), atol=1e-6, rtol=1e-5)  # still the base
    live = logps(actor.model, batch)
    assert (live - ref).abs().max() > 1e-3  # the trained adapter: far beyond rounding (0.026)
    torch.testing.assert_close(logps(separate.engine.model, batch), live, atol=1e-5, rtol=0)


def test_asynchronous_rollout_trains_with_a_bounded_weight_lag(tiny_grpo):
    from keel.controller import run_training
    from keel.monitor import read_metrics

    cfg = tiny_grpo("train.steps=3", "rollout.max_staleness=1", "checkpoint.save_steps=0")
    run_training(cfg)
    rows = [r for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert [r["rollout/weight_version_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0]  # pushed each step
    assert all("timing/rollout_wait_s" in r and r["actor/grad_norm"] > 0 for r in rows)


def test_asynchronous_pi_old_is_the_trainers_recomputation_not_the_engines(tiny_dir):
    """rollout.max_staleness 1 with the engine's log-probs kept: a batch generated one update
    ago is trained with π_old = the trainer's log-probs under its current weights (recomputed
    just before the update), not the rollout engine's, so the drift metric sees the lag (≈ 0
    at lag 0, clearly > 0 at lag 1) and PPO's ratio starts at 1 (ppo_kl 0)."""
    from keel.engine.forward import response_forward

    graded = {"fn": f"{Path(__file__).parents[1] / 'cli/format_reward.py'}:digit_fraction"}
    ctl = controller(tiny_dir, {"name": "grpo"}, reward=graded, rollout={
        "n": 2, "max_new_tokens": 4, "max_staleness": 1, "return_logprobs": True,
    }, train={"batch_size": 4, "lr": 1e-3, "warmup_steps": 0, "steps": 3})  # fmt: skip
    actor = ctl.roles.actor.workers[0]
    trained: list[tuple[Batch, torch.Tensor]] = []  # (the batch, the trainer's log-probs)

    def spy(call):
        def wrapped(method, *args, **kwargs):
            if method is ActorWorker.update:
                with torch.no_grad():
                    live = response_forward(actor.model.eval(), args[0],
                                            temperature=actor.temperature)[0]  # fmt: skip
                trained.append((args[0], live))
            return call(method, *args, **kwargs)

        return wrapped

    ctl.roles.actor.call = spy(ctl.roles.actor.call)
    try:
        metrics = [ctl.step(step) for step in (1, 2, 3)]
    finally:
        ctl.rollouts.close()
    assert [m["rollout/weight_version_lag"] for m in metrics] == [0.0, 1.0, 1.0]
    for (batch, live), m in zip(trained, metrics, strict=True):
        mask = batch.response_mask.bool()
        torch.testing.assert_close(batch.old_logprobs[mask], live[mask], atol=1e-5, rtol=0)
        assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        assert m["actor/grad_norm"] > 0  # graded rewards: every update moves the policy
    assert metrics[0]["rollout/logprob_abs_diff"] < 1e-4  # the engine's copy: the same weights
    for (batch, live), m in zip(trained[1:], metrics[1:], strict=True):
        gap = (batch.rollout_logprobs - live)[batch.response_mask.bool()].abs()
        assert m["rollout/logprob_abs_diff"] > 1e-3, m["rollout/logprob_abs_diff"]
        assert m["rollout/logprob_abs_diff_max"] == pytest.approx(float(gap.max()), rel=1e-3)


def test_a_batch_older_than_max_staleness_is_refused(tiny_grpo):
    from keel.controller.rl import RLController

    controller = RLController.__new__(RLController)
    controller.weight_version, controller.max_staleness = 5, 2
    ok = Batch(meta={"weight_version": 3})
    controller.check_weight_version(ok)
    assert ok.meta["weight_version_lag"] == 2
    with pytest.raises(RuntimeError, match="max_staleness 2 allows 3 to 5"):
        controller.check_weight_version(Batch(meta={"weight_version": 2}))


@pytest.mark.parametrize("algorithm", [{"name": "grpo"}, PPO], ids=["grpo", "ppo"])
def test_the_single_turn_environment_trains_exactly_as_no_environment(tiny_dir, algorithm):
    """rollout.env: builtin:single_turn plays one-turn episodes through the episode runner: the
    weights and every metric the plain run logs are bitwise the plain run's."""
    runs = []
    for rollout in ({}, {"env": "builtin:single_turn"}):
        torch.manual_seed(0)
        ctl = controller(tiny_dir, algorithm, rollout={"n": 2, "max_new_tokens": 4, **rollout})
        metrics = [ctl.step(step) for step in (1, 2, 3)]
        runs.append((params(ctl.roles.actor), metrics))
    (w_plain, m_plain), (w_env, m_env) = runs
    assert same(w_plain, w_env)
    for plain, env in zip(m_plain, m_env, strict=True):
        assert env["episode/turns_mean"] == 1.0 and env["episode/end_done_frac"] == 1.0
        assert {k: v for k, v in plain.items() if not k.startswith(("timing/", "perf/"))} == {
            k: v for k, v in env.items() if not k.startswith(("timing/", "perf/", "episode/"))
        }


def test_an_episode_is_truncated_when_its_last_turn_is_cut():
    """Holes: the last valid token is the last turn's, not the mask's count of ones."""
    eos = 2
    # response columns: turn (7, EOS), observation (4, 4: holes), turn (8, EOS) / (8, 9: cut)
    ids = torch.tensor([[5, 7, eos, 4, 4, 8, eos], [5, 7, eos, 4, 4, 8, 9]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]] * 2)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                  meta={"eos_token_ids": [eos]})  # fmt: skip
    assert truncated_rows(batch).tolist() == [False, True]


def test_a_reward_timeout_is_a_warning_event_of_the_run(tiny_grpo, tmp_path):
    """The scorer's warnings (here a call past reward.timeout_s under on_error: fallback) travel
    in the scored batch to the controller and become `warning` events of events.jsonl."""
    from keel.controller import run_training
    from keel.guard.events import read_events

    slow = tmp_path / "slow_reward.py"
    slow.write_text(
        "import threading\n"
        "_first = threading.Event()\n"
        "def fn(prompt, response, answer, **kwargs):\n"
        "    if not _first.is_set():\n"
        "        _first.set()\n"
        "        threading.Event().wait(3)  # past reward.timeout_s\n"
        "    return 0.0\n"
    )
    cfg = tiny_grpo(
        "train.steps=1", f"reward.fn={slow}:fn", "reward.kwargs={}", "reward.on_error=fallback",
        "reward.timeout_s=0.2", "checkpoint.save_steps=0",
    )  # fmt: skip
    run_training(cfg)
    events = read_events(Path(cfg.run_dir) / "events.jsonl")
    [warning] = [e for e in events if e["event"] == "warning"]
    assert warning["rule"] == "reward_timeout" and warning["step"] == 1
    assert "reward.timeout_s" in warning["message"] and "slow_reward.py" in warning["message"]


# ---------------------------------------------------------------- rollout correction
def off_policy(ctl, factor: float = 0.3):
    """The controller's HF engine sampling at `factor` × its temperature (reporting its own
    log-probs): a batch clearly off-policy for the trainer (tests/learning/perturbed.py; the
    random tiny model's logits are small, so a colder engine moves them the most)."""
    from tests.learning.perturbed import HotterEngine

    worker = ctl.roles.rollout.workers[0]
    worker.engine = HotterEngine(worker.engine, factor)
    return ctl


def correction_controller(tiny_dir, correction, **rollout):
    graded = {"fn": f"{Path(__file__).parents[1] / 'cli/format_reward.py'}:digit_fraction"}
    return controller(tiny_dir, {"name": "grpo", "rollout_correction": correction},
                      reward=graded, rollout={"n": 4, "max_new_tokens": 4,
                                              "return_logprobs": True, **rollout},
                      train={"batch_size": 4, "mini_batch_size": 8, "lr": 1e-3,
                             "warmup_steps": 0, "steps": 4})  # fmt: skip


def finite_keys(metrics, prefix):
    keys = [k for k in metrics if k.startswith(prefix)]
    assert keys, f"no {prefix} metrics"
    assert all(math.isfinite(metrics[k]) for k in keys), {k: metrics[k] for k in keys}
    return keys


def test_a_decoupled_correction_step_weights_rejects_and_logs(tiny_dir):
    """Sequence IS and two rejection options on an off-policy engine: the weights are on the trained
    batch, rejected tokens left its mask (and have advantage 0), every rollout_corr/* and
    training/* metric is there and finite, and the update still moves the policy."""
    ctl = off_policy(correction_controller(tiny_dir, {
        "rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0,0.2"}))  # fmt: skip
    seen = []
    ctl.roles.actor.call = _spy(ctl.roles.actor.call, seen)
    before = params(ctl.roles.actor)
    metrics = ctl.step(1)
    assert ActorWorker.compute_logprobs in seen and not same(before, params(ctl.roles.actor))
    keys = finite_keys(metrics, "rollout_corr/")
    assert "rollout_corr/rollout_is_batch_norm_factor" in keys
    assert "rollout_corr/rollout_rs_token_k1_masked_fraction" in keys
    assert len(finite_keys(metrics, "training/")) == 5
    batch = ctl.last_batch
    assert batch.rollout_is_weights is not None and not batch.rollout_is_weights.requires_grad
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert metrics["rollout/logprob_kl"] > 0.05  # the engine's drift, over the sampled m
    sampled = batch.token_weight_versions is not None  # (the batch's own m is now m')
    assert sampled and batch.response_mask.sum() < batch.attention_mask[:, -4:].sum()
    assert torch.all(batch.advantages[batch.response_mask == 0] == 0)


def test_bypass_ppo_clip_takes_the_engines_logprobs_as_pi_old_and_logs_from_the_loss(tiny_dir):
    """Bypass: no old-log-prob pass, π_old is the engine's (so PPO's ppo_kl, MM(ℓ_roll − ℓ_θ),
    is the loss's rollout_corr/kl on an off-policy engine, not the ≈ 0 of a trainer's
    recomputation); the loss's rollout_corr/* come without the actor/ prefix; no
    rollout/logprob_*."""
    check_bypass_step(tiny_dir, "bypass_ppo_clip")


def test_bypass_reinforce_takes_the_engines_logprobs_as_pi_old_and_logs_from_the_loss(tiny_dir):
    """The same with REINFORCE and sequence IS (bypass_pg_is): no clipping at all."""
    check_bypass_step(tiny_dir, "bypass_pg_is")


def check_bypass_step(tiny_dir, preset):
    ctl = off_policy(correction_controller(tiny_dir, {"preset": preset}))
    seen = []
    ctl.roles.actor.call = _spy(ctl.roles.actor.call, seen)
    before = params(ctl.roles.actor)
    metrics = ctl.step(1)
    assert "compute_logprobs" not in seen and not same(before, params(ctl.roles.actor))
    assert torch.equal(ctl.last_batch.old_logprobs, ctl.last_batch.rollout_logprobs)
    finite_keys(metrics, "rollout_corr/")
    assert not any(k.startswith(("actor/rollout_corr", "rollout/logprob", "training/"))
                   for k in metrics)  # fmt: skip
    assert metrics["rollout_corr/kl"] > 0.05
    assert metrics["actor/ppo_kl"] == pytest.approx(metrics["rollout_corr/kl"], rel=1e-4)
    if preset == "bypass_pg_is":  # REINFORCE: no clipping
        assert metrics["actor/clipfrac"] == 0.0
        assert "rollout_corr/rollout_is_mean" in metrics


def test_a_correction_with_asynchronous_rollout_covers_the_lag(tiny_dir):
    """rollout.max_staleness 1 with IcePop: the batch generated one update ago trains with the
    correction's metrics finite, and the lag shows in its drift."""
    ctl = correction_controller(tiny_dir, {"preset": "decoupled_token_icepop"}, max_staleness=1)
    try:
        metrics = [ctl.step(step) for step in (1, 2)]
    finally:
        ctl.rollouts.close()
    assert [m["rollout/weight_version_lag"] for m in metrics] == [0.0, 1.0]
    for m in metrics:
        finite_keys(m, "rollout_corr/")
    assert metrics[1]["rollout_corr/rollout_is_oob_ratio"] >= 0
    assert metrics[1]["rollout/logprob_abs_diff"] > metrics[0]["rollout/logprob_abs_diff"]


def test_grpo_sees_the_rejection_before_its_advantages(tiny_dir):
    """Row 1's tokens are rejected (token_k1 '0.5_2.0': its ratio is 4): its advantages are 0,
    and the estimator saw m' with every row's score: the rejected row's score 0 still enters
    its group's mean and std (rows 0, 1: scores 1, 0 → Â = ±½/(√½ + ε))."""
    check_rejection_before_advantages(tiny_dir, "grpo")


def test_reinforce_pp_baseline_whitens_over_the_kept_tokens_only(tiny_dir):
    """The same batch: the group-centred scores [½, −½, 0, 0] whitened over the kept tokens
    only (rows 0, 2, 3; unbiased variance), 0 on the rejected row."""
    check_rejection_before_advantages(tiny_dir, "reinforce_pp_baseline")


def check_rejection_before_advantages(tiny_dir, algorithm):
    no_kl = {"use_kl_in_reward": False} if algorithm != "grpo" else {"kl_loss_coef": 0.0}
    ctl = controller(tiny_dir, {"name": algorithm, **no_kl, "rollout_correction": {
        "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}},
        rollout={"n": 2, "max_new_tokens": 4, "return_logprobs": True})  # fmt: skip
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    roll = torch.full((4, 3), -1.0)
    old = roll + torch.tensor([[0.1], [math.log(4)], [-0.2], [0.0]])
    batch = Batch(
        response_mask=mask,
        old_logprobs=old,
        rollout_logprobs=roll,
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    out, metrics = ctl.compute_advantages(batch)
    kept = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert torch.equal(out.response_mask, kept)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 8)
    if algorithm == "grpo":
        a = 0.5 / (math.sqrt(0.5) + 1e-6)
        expected = torch.tensor([[a, a, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    else:
        values = [0.5, 0.5, 0.0, 0.0, 0.0]  # row 0's two tokens, row 2's one, row 3's two
        mu = sum(values) / 5
        sd = math.sqrt(sum((v - mu) ** 2 for v in values) / 4 + 1e-8)
        w = [(v - mu) / sd for v in values]
        expected = torch.tensor([[w[0], w[1], 0], [0, 0, 0], [w[2], 0, 0], [w[3], w[4], 0]])
    torch.testing.assert_close(out.advantages, expected.float(), atol=1e-5, rtol=1e-5)
