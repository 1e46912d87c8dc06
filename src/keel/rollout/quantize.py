"""Quantized rollout weights (`rollout.quantization`): the rollout engine's copy of the policy
with its Linear layers held in 8 bits while the trainer keeps full precision.

- int8 (CPU): W8A8. Symmetric per-output-channel int8 weights; each call quantizes its
  activations to int8 per token (symmetric, each row's own scale) and multiplies in integers
  (`torch._int_mm`, int32 accumulation, exact), then rescales by both scales. Measured on this
  project's 2-core CPU at SmolLM2-135M's decode shapes (16 rows, 576 → 1536) the matmul is
  ~2× faster than float32's; at the tiny test model's shapes (64 → 256) the quantization's
  fixed cost makes it slower (docs/performance.md). Choices measured and not taken: PyTorch's
  dynamic-quantized linear (`quantize_dynamic`'s kernel, deprecated) is ~2× faster again but
  quantizes activations per tensor: on SmolLM2, whose MLP activations have outlier channels,
  the next-token KL to float32 was 0.99 nats (0.49 with its 8-bit range), against 0.044 per
  token; weight-only int8 (`torch._weight_int8pack_mm`, or dequantize-then-matmul) was 1.5× to
  20× slower than float32 on this CPU.
- fp8 (CUDA only): weight-only float8_e4m3fn with per-output-channel scales, dequantized to
  the activations' dtype in each matmul (half the weight memory of bf16; a speed-up needs an
  FP8 matmul such as `torch._scaled_mm`, not wired). Untested on a GPU in this repository.

The input and output embeddings (the LM head, tied to the input embeddings in the tiny and
SmolLM2 models) stay in full precision, unless `rollout.quantization_lm_head` quantizes the
head too (SmolLM2: 1.84× float32's generation instead of 1.48×, a larger gap). A weight
push (`update_weights`, i.e. `load_state_dict` of the full-precision state) re-quantizes every
layer from the pushed weights: `QuantizedLinear` takes `weight` / `bias` keys like the
`nn.Linear` it replaced."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

QUANTIZATIONS = ("int8", "fp8")
# int8 × int8 → int32 matmul (private in torch's typing, public in use: torchao and gpt-fast
# call it); None where this build lacks it (int8_kernel_available says so)
INT_MM: Any = getattr(torch, "_int_mm", None)
INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def per_channel_scales(weight: torch.Tensor, top: float) -> torch.Tensor:
    """[out] float32 scales of a [out, in] weight: each row's largest magnitude maps to `top`
    (an all-zero row gets scale 1, so it quantizes to zeros)."""
    amax = weight.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: (q [out, in] int8 in [-127, 127], scales [out] float32) with
    weight ≈ q · scales[:, None]; the error of each entry is at most scales[row] / 2."""
    scales = per_channel_scales(weight, INT8_MAX)
    q = torch.round(weight.detach().float() / scales[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float8_e4m3fn: (q [out, in] float8_e4m3fn, scales [out] float32) with
    weight ≈ q · scales[:, None]; 3 mantissa bits: a relative error of at most 2^-4 per entry
    (above the format's subnormals)."""
    scales = per_channel_scales(weight, FP8_MAX)
    q = (weight.detach().float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 weight of (q, scales) from `quantize_int8` / `quantize_fp8`."""
    return q.float() * scales[:, None]


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of activations x [M, K]: (q [M, K] int8, scales [M, 1] float32)
    with x ≈ q · scales (an all-zero row: scale 1)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.round(x / scales).to(torch.int8), scales


def int8_kernel_available() -> bool:
    """Whether this PyTorch build multiplies int8 matrices on the CPU (`torch._int_mm`)."""
    if INT_MM is None:
        return False
    try:
        INT_MM(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except RuntimeError:
        return False
    return True


def unsupported_reason(scheme: str, device: torch.device) -> str | None:
    """Why `rollout.quantization: scheme` cannot run on `device` (None: it can)."""
    if scheme == "int8":
        if device.type != "cpu":
            return "int8 runs on the CPU (torch._int_mm); use fp8 on CUDA"
        if not int8_kernel_available():
            return "this PyTorch build has no int8 matmul on the CPU (torch._int_mm)"
        return None
    if scheme == "fp8":
        if device.type != "cuda":
            return "fp8 needs CUDA (the engine's device is " + device.type + ")"
        return None
    return f"unknown scheme {scheme!r} (one of {', '.join(QUANTIZATIONS)})"


class QuantizedLinear(nn.Module):
    """An `nn.Linear` whose weight is held quantized (`scheme` int8 or fp8) and re-quantized
    from every full-precision weight loaded into it (`load_state_dict` with the Linear's keys
    `weight` and `bias`). Inference only: no gradients flow through it."""

    def __init__(self, linear: nn.Linear, scheme: str):
        super().__init__()
        if scheme not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {scheme!r} (one of {QUANTIZATIONS})")
        self.scheme = scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.has_bias = linear.bias is not None
        self.register_buffer("bias", None)
        self.register_buffer("qweight", None)
        self.register_buffer("scales", None)
        self.set_weight(linear.weight, linear.bias)

    def set_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize a full-precision [out, in] weight (and keep the bias as given, float)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} for a "
                f"{self.out_features}×{self.in_features} layer"
            )
        b = bias.detach().float().to(weight.device) if bias is not None else None
        q, scales = quantize_int8(weight) if self.scheme == "int8" else quantize_fp8(weight)
        self.qweight, self.scales, self.bias = q, scales, b

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight this layer computes with."""
        assert self.qweight is not None and self.scales is not None
        return dequantize(self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.qweight is not None and self.scales is not None
        if self.scheme == "int8":
            rows = x.reshape(-1, self.in_features).float()
            xq, xs = quantize_rows_int8(rows)
            y = INT_MM(xq, self.qweight.t()).float() * xs * self.scales
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        w = self.qweight.to(x.dtype) * self.scales[:, None].to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, w, bias)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """The replaced Linear's keys: `weight` (required) and `bias` (when it had one)."""
        weight = state_dict.get(prefix + "weight")
        bias = state_dict.get(prefix + "bias")
        if weight is None:
            missing_keys.append(prefix + "weight")
        if self.has_bias and bias is None:
            missing_keys.append(prefix + "bias")
        if strict:
            known = {prefix + "weight", prefix + "bias"}
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix) :]
                and k not in known
            )  # fmt: skip
        if weight is not None:
            try:
                self.set_weight(weight, bias if self.has_bias else None)
            except ValueError as e:
                error_msgs.append(f"{prefix}weight: {e}")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.has_bias}, scheme={self.scheme}"
        )


def quantize_model(model: nn.Module, scheme: str, *, lm_head: bool = False) -> int:
    """Replace, in place, every `nn.Linear` of `model` but its output embeddings (the LM head;
    `lm_head` True: that one too) by a `QuantizedLinear` of `scheme`; returns how many were
    replaced. A head tied to the input embeddings is untied by it: the embeddings stay float,
    the head holds its own quantized copy, refreshed from the pushed `lm_head.weight`."""
    keep: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if isinstance(head, nn.Module) and not lm_head:
        keep.add(id(head))
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) not in keep
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(linear, scheme))
    model.requires_grad_(False)
    return len(targets)


def quantized_layers(model: nn.Module) -> list[QuantizedLinear]:
    """The model's quantized layers, in module order."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]
