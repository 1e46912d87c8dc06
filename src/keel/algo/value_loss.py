"""The critic's clipped value loss (docs/algorithms.md §3, verl `compute_value_loss`)."""

from __future__ import annotations

import torch

from keel.algo.aggregation import agg_loss
from keel.algo.masked import masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None = 0.5,
    agg_mode: str = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, vf_clipfrac). V_new, V_old, Ret, m: [B, R].

    V̂ = clip(V_new, V_old − ε_v, V_old + ε_v);
    L_V = ½ · agg(max((V_new − Ret)², (V̂ − Ret)²), m, mode); vf_clipfrac = masked mean[clipped >
    unclipped] (strict). cliprange_value None: no clipping (plain ½(V − Ret)²).
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    v_old = torch.where(m, old_values, zero)
    ret = torch.where(m, returns, zero)
    unclipped = (v - ret) ** 2
    if cliprange_value is None:
        clipped = unclipped
    else:
        # clip(V_new, V_old − ε_v, V_old + ε_v) as a clamp of V_new itself: inside the range
        # V̂ is V_new exactly (V_old + (V_new − V_old) can round 1 ulp off it, and then
        # `clipped > unclipped` counted an unclipped token as clipped by rounding)
        v_hat = torch.clamp(v, v_old - cliprange_value, v_old + cliprange_value)
        clipped = (v_hat - ret) ** 2
    per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * agg_loss(
        per_token, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), m)
    return loss, clipfrac
