"""The dtypes of one layer call, as Tutel's layer has them.

- tokens: under ``torch.autocast`` on their device, its dtype (the exchange
  moves it: half the bytes of float32 in bfloat16); otherwise the experts'
  parameter dtype (a float64 layer takes float32 tokens in float64);
- the gate: autocast off, so the logits, scores and gates keep the gate's
  own dtype (float32 with ``fp32_gate``, whatever the tokens' dtype);
- the experts: under the caller's autocast, as any module;
- the output: the input's dtype;
- the dispatch (``MoELayer(dispatch_dtype=...)``): the tokens' dtype, or
  FP8 with one float32 scale per 128 channels (DeepSeek-V3 and DeepEP's
  format, a2a.quantize_fp8) on the way to the experts only: quantized once,
  before the exchange, dequantized to the tokens' dtype at the experts; the
  combine and every gradient exchange stay in the tokens' dtype, and the
  quantization passes gradients straight through.
"""

from __future__ import annotations

import contextlib

import torch

import a2a

__all__ = ["DISPATCH_DTYPES", "FP8_BLOCK", "compute_dtype", "dispatch_format", "routing_precision"]

# MoELayer(dispatch_dtype=...) -> a2a's FP8 format; None: the tokens' own dtype.
DISPATCH_DTYPES = a2a.FP8_DTYPES
# Channels per scale of the FP8 dispatch (DeepSeek-V3's 1 x 128 tiles).
FP8_BLOCK = a2a.FP8_BLOCK_DEFAULT


def compute_dtype(x: torch.Tensor, parameter_dtype: torch.dtype) -> torch.dtype:
    """The dtype the layer's tokens travel and are computed in."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return parameter_dtype


def routing_precision(device_type: str) -> contextlib.AbstractContextManager:
    """The gate's context: autocast off on the tokens' device."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def dispatch_format(dispatch_dtype: object) -> str | None:
    """The a2a FP8 format of ``MoELayer(dispatch_dtype=...)`` (a name of
    DISPATCH_DTYPES or the torch dtype), None for None; ValueError otherwise."""
    if dispatch_dtype is None:
        return None
    name = str(dispatch_dtype).removeprefix("torch.")
    if name not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch_dtype must be None (the tokens' dtype) or one of {sorted(DISPATCH_DTYPES)} "
                         f"(or the torch dtype), got {dispatch_dtype!r}")
    return DISPATCH_DTYPES[name]
