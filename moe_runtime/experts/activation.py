"""The experts' activation in the hand-written FFN backward passes (flows.py, ragged_ffn.py).

What the forward keeps of the hidden layer, and how the backward gets the
activation's output and its gradient from it: relu is applied in place, so the
kept tensor is its output (and its derivative is the mask output > 0); any
other function keeps the pre-activation, and autograd differentiates it again
in the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_RELU = (F.relu, torch.relu)

Activation = Callable[[torch.Tensor], torch.Tensor]


def is_relu(activation: Activation) -> bool:
    return activation in _RELU


def activate(activation: Activation, hidden: torch.Tensor) -> torch.Tensor:
    """The activation of `hidden`; relu overwrites `hidden` with it (what is kept)."""
    if is_relu(activation):
        return hidden.relu_()
    return activation(hidden)


def activation_backward(activation: Activation, kept: torch.Tensor,
                        grad_activated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the activation's output, the gradient at its input) from the kept
    hidden tensor of `activate`; relu's gradient is masked in place in
    `grad_activated`."""
    if is_relu(activation):
        # grad_activated where kept > 0, else 0, in place: one kernel (a mask and masked_fill_ were two, and a
        # temporary); the same bits, NaN and -0.0 included (threshold_backward's rule is kept <= 0 -> 0).
        return kept, torch.ops.aten.threshold_backward.grad_input(grad_activated, kept, 0, grad_input=grad_activated)
    with torch.enable_grad():
        pre = kept.detach().requires_grad_(True)
        activated = activation(pre)
        (grad_pre,) = torch.autograd.grad(activated, pre, grad_activated)
    return activated.detach(), grad_pre
