"""keel.algo allocates nothing on the host by itself: every tensor it creates lives on the device
of its inputs (a CUDA run would otherwise mix devices and crash at its first update).

Two checks, runnable without a GPU: (1) every function, on CPU inputs, under a torch function
mode that records each factory call (torch.zeros, arange, full, …) made without a `device=`;
(2) the functions whose shapes do not depend on values run on the `meta` device, where any host
tensor they made would be mixed with meta ones and raise.
"""

from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from keel.algo import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RS_OPTIONS,
    agg_loss,
    clipped_value_loss,
    decoupled_correction,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_explained_variance,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    resolve_correction,
    sft_loss,
    token_level_rewards,
    varied_groups,
)
from keel.algo.correction import ISThreshold
from keel.algo.kl import batch_mean_kl
from keel.algo.preference import DPO_LOSSES, dpo_loss, sequence_logps

FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor,
    torch.as_tensor, torch.eye, torch.linspace, torch.rand, torch.randn, torch.randint,
    torch.scalar_tensor,
}  # fmt: skip


class HostAllocations(TorchFunctionMode):
    """Records factory calls that name no device (they would land on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


B, R, V = 6, 5, 11


def inputs(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 0, 5, 2])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    cpu = {
        "logprobs": -torch.rand(B, R, generator=g) - 0.1,
        "old": -torch.rand(B, R, generator=g) - 0.1,
        "ref": -torch.rand(B, R, generator=g) - 0.1,
        "adv": torch.randn(B, R, generator=g),
        "values": torch.randn(B, R, generator=g),
        "returns": torch.randn(B, R, generator=g),
        "mask": mask,
        "scores": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0]),
        "groups": torch.tensor([0, 0, 0, 1, 1, 2]),
        "logits": torch.randn(B, R, V, generator=g),
        "labels": torch.randint(0, V, (B, R), generator=g),
    }
    return {k: v.to(device) for k, v in cpu.items()}


EVERY_RS = resolve_correction({"rollout_rs": ",".join(RS_OPTIONS), "rollout_rs_threshold": 2.0})
CORRECTIONS = [
    replace(EVERY_RS, is_level="token", batch_normalize=True, bypass=True),
    replace(EVERY_RS, is_level="sequence", is_threshold=ISThreshold(5.0, 0.5), bypass=True,
            loss_type="reinforce"),
]  # fmt: skip


def every_algo_call(x: dict[str, torch.Tensor], *, value_dependent: bool = True) -> None:
    """Calls every function of keel.algo that a step uses, in every registered variant."""
    m = x["mask"]
    for name, loss in POLICY_LOSSES.items():
        if name == "bypass_mode":  # reads values (its rejection counts): below
            continue
        for mode in AGG_MODES:
            loss(x["logprobs"], x["old"], x["adv"], m, agg_mode=mode, num_tokens=13, num_seqs=5)
    for kind in KL_ESTIMATORS:
        kl = kl_penalty(x["logprobs"], x["ref"], kind)
        agg_loss(kl, m, mode="token-mean", num_tokens=13, num_seqs=5)
    clipped_value_loss(x["values"], x["returns"] * 0.5, x["returns"], m, num_tokens=13, num_seqs=5)
    sft_loss(x["logprobs"], m, agg_mode="token-mean", num_tokens=13, num_seqs=5)
    logprobs_from_logits(x["logits"], x["labels"])
    entropy_from_logits(x["logits"])
    masked_mean(x["adv"], m)
    token_level_rewards(x["scores"], m, kl_penalty(x["old"], x["ref"], "k1"), 0.1)
    token_level_rewards(x["scores"], m)
    overlong_penalty(m.sum(dim=1), max_length=R, buffer_length=2, penalty_factor=1.0)
    if not value_dependent:  # below: shapes or branches that depend on values (no meta)
        return
    masked_whiten(x["adv"], m)
    for correction in CORRECTIONS:  # rollout correction: every option, both modes
        decoupled_correction(x["old"], x["ref"], m, correction)
        for mode in AGG_MODES:
            bypass = POLICY_LOSSES["bypass_mode"]
            bypass(x["logprobs"], x["old"], x["adv"], m, agg_mode=mode, num_tokens=13,
                   num_seqs=5, correction=correction)  # fmt: skip
    seq = sequence_logps(x["logprobs"], m)
    for loss_type in DPO_LOSSES:  # its metrics are read back as floats
        lengths = m.sum(dim=1)
        dpo_loss(seq[0::2], seq[1::2], seq[1::2] * 0.9, seq[0::2] * 1.1, loss_type=loss_type,
                 chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])  # fmt: skip
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        values = x["values"] if name == "gae" else None
        estimator(token_rewards=token_level_rewards(x["scores"], m), response_mask=m,
                  group_ids=x["groups"], values=values)  # fmt: skip
    varied_groups(x["scores"], x["groups"])
    masked_explained_variance(x["values"], x["returns"], m)
    masked_explained_variance(x["values"], torch.zeros_like(x["returns"]), m)  # the NaN path
    batch_mean_kl(kl_penalty(x["old"], x["ref"], "k3"), m)


def test_nothing_in_keel_algo_allocates_on_the_host_implicitly():
    recorder = HostAllocations()
    x = inputs()
    with recorder:
        every_algo_call(x)
    assert recorder.calls == []


def test_the_recorder_catches_an_implicit_host_allocation():
    """The check above can fail: a factory call without a device is recorded."""
    recorder = HostAllocations()
    with recorder:
        torch.zeros(3)
        torch.zeros(3, device="cpu")
    assert recorder.calls == ["zeros"]


def test_the_step_math_runs_on_the_meta_device():
    """Losses, KL, log-probs and aggregation on meta tensors: a host tensor would raise."""
    every_algo_call(inputs("meta"), value_dependent=False)


def test_a_host_tensor_mixed_into_meta_math_raises():
    """The meta check can fail: mixing a non-scalar host tensor with meta ones raises."""
    x = inputs("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        _ = x["mask"] + torch.zeros(R)
