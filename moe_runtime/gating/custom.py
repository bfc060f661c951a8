"""A user's gate: any torch module whose forward(x (T, M)) returns the
logits (T, E), given to MoELayer as an instance in ``gate_type`` (Tutel's
``{'type': 'custom', 'module': cls, ...}`` builds one: moe_runtime.moe).

What the layer reads of a gate, and what a user's gate gets when it lacks it:

    top_k            required (Tutel's gates and Tutel's custom-gate example set it)
    capacity_factor  0.0 (MoELayer's default; Tutel's moe_layer: CAP_FACTOR or 1.0)
    gate_noise       0.0
    z_loss_coef      0.0
    num_global_experts  E (the logits' width is checked against it at each call)

The module initializes its own parameters (MoELayer's gate seed draws only
the built-in gates'); as every gate's, rank 0's values are taken on every
rank at construction.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["checked_logits", "custom_gate"]

DEFAULTS = {"capacity_factor": 0.0, "gate_noise": 0.0, "z_loss_coef": 0.0}


def custom_gate(gate: torch.nn.Module, num_experts: int, defaults: dict[str, Any] | None = None) -> torch.nn.Module:
    """`gate` (the user's module itself, so that its state_dict keys are its
    own) with the attributes the layer reads; `defaults` overrides DEFAULTS."""
    name = type(gate).__name__
    top_k = getattr(gate, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"gate_type: the gate module {name} has top_k {top_k!r}; a gate sets self.top_k to the "
                         "number of experts each token goes to (an integer >= 1)")
    gate.top_k = min(top_k, num_experts)  # as Tutel: k above E means E
    for key, value in {**DEFAULTS, **(defaults or {})}.items():
        if not hasattr(gate, key):
            setattr(gate, key, value)
    if not hasattr(gate, "num_global_experts"):
        gate.num_global_experts = num_experts
    elif gate.num_global_experts != num_experts:
        raise ValueError(f"gate_type: the gate module {name} has num_global_experts {gate.num_global_experts!r}, "
                         f"but the layer has {num_experts} experts")
    return gate


def checked_logits(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gate(x), refused unless floating (T, E) logits for x's T tokens."""
    logits = gate(x)
    expected = (x.shape[0], getattr(gate, "num_global_experts", None) or getattr(logits, "shape", (0, 0))[-1])
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or tuple(logits.shape) != expected:
        shown = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"the gate {type(gate).__name__} returned {shown} for {x.shape[0]} tokens; a gate "
                         f"returns floating logits of shape (T, E) = {expected}")
    return logits
