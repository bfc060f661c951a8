"""The dtypes of one layer call, as Tutel's layer has them.

- tokens: under ``torch.autocast`` on their device, its dtype (the exchange
  moves it: half the bytes of float32 in bfloat16); otherwise the experts'
  parameter dtype (a float64 layer takes float32 tokens in float64);
- the gate: autocast off, so the logits, scores and gates keep the gate's
  own dtype (float32 with ``fp32_gate``, whatever the tokens' dtype);
- the experts: under the caller's autocast, as any module;
- the output: the input's dtype.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["compute_dtype", "routing_precision"]


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
