"""The fused top-k gate as one torch autograd node (``a2a.torch.top_k_gate``;
``a2a.top_k_gate`` comes here when the logits require grad while grad mode
is on): a2a_top_k_gate forward, a2a_top_k_gate_backward backward, one native
call each way. The gates and the loss differentiate; the scores, the indices
and the share carry no gradient. Differentiable once (the backward is the
native call, not recorded)."""

from __future__ import annotations

import torch

from ._gate_kernels import top_k_gate_backward, top_k_gate_kernel

__all__ = ["top_k_gate"]


def top_k_gate(logits: torch.Tensor, k: int, *, normalize: bool = False):
    """(scores, indices, gates, share, l_aux) of ``a2a.top_k_gate``, recording autograd."""
    return _TopKGate.apply(logits, k, normalize)


class _TopKGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, k: int, normalize: bool):
        scores, indices, gates, share, l_aux = top_k_gate_kernel(logits, k, normalize=normalize)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(scores, indices, share)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scores, indices, share)
        return scores, indices, gates, share, l_aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _scores, _indices, d_gates, _share, d_l_aux):
        if d_gates is None and d_l_aux is None:
            return None, None, None
        scores, indices, share = ctx.saved_tensors
        if d_gates is not None and not d_gates.is_contiguous():
            d_gates = d_gates.contiguous()  # e.g. the expanded gradient of gates.sum()
        return top_k_gate_backward(scores, indices, share, d_gates, d_l_aux, normalize=ctx.normalize), None, None
