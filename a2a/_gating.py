"""The fused top-k gate: what a top-k router computes from its logits, in one
native call forward and one backward (a2a_top_k_gate in a2a.h).

For logits (T, E) of float32, float64, float16 or bfloat16 (16-bit ones
computed in float32 and rounded where torch's ops on them round: the
scores, the chosen scores' sum, each gate)::

    scores  = softmax(logits, dim=1)                                  (T, E)
    indices = the k largest scores of each token, best first, ranked by
              their logits (the softmax's order, which a rounded score
              may blur); equal logits by the lower expert; a row of NaN
              scores (a NaN or infinite logit) chooses 0..k-1        (T, k) int64
    gates   = scores at indices, divided by max(their sum, eps)
              when normalize (eps: the dtype's machine epsilon)        (T, k)
    share   = the tokens' share of first choices per expert            (E,)
    l_aux   = E * sum_e mean_t(scores[:, e]) * share[e]   (GShard's loss)  ()

``top_k_gate_backward`` takes the gradients of the gates and of l_aux
(either may be None) and gives the logits'. Torch logits that require grad
record autograd through a2a.torch, whose node runs the two (the gates and
l_aux differentiate; the scores, indices and share do not). On a GPU the forward is
three kernels and the backward one; neither reads anything back, so both can
be captured in a CUDA graph. NumPy, torch and CuPy arrays, on the arrays'
device (the current stream on CUDA).
"""

from __future__ import annotations

from typing import Any

from ._arrays import records_autograd
from ._gate_kernels import top_k_gate_backward, top_k_gate_kernel

__all__ = ["top_k_gate", "top_k_gate_backward"]


def top_k_gate(logits: Any, k: int, *, normalize: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """(scores, indices, gates, share, l_aux) of logits (T, E) (module
    docstring); new arrays beside the logits, of their dtype. Torch logits
    that require grad while grad mode is on record autograd (a2a.torch)."""
    if records_autograd(logits):
        from . import torch as autograd

        return autograd.top_k_gate(logits, k, normalize=normalize)
    return top_k_gate_kernel(logits, k, normalize=normalize)
