"""The routing decision of a top-k gate as one autograd node with a written backward.

Left to autograd, softmax -> top-k -> normalized gates -> GShard's loss records
about fifteen nodes and runs about thirty ops backward, most of them the
generic backward of a division, a clamp, an expand and two means: each op a
launch on a GPU and a few microseconds of host work anywhere. Here the forward
runs the same ops, so every value is bitwise what autograd's path computes,
and the backward is the few ops the math needs::

    forward, logits (T, E):
        scores = softmax(logits)                 (T, E)  no gradient: the flows read it detached
        r, idx = topk(scores, k)                 (T, k)  r[t, j] = scores[t, idx[t, j]]
        S      = max(sum_j r[t, j], eps)         (T, 1)  normalize_gate and k > 1 (else gates = r)
        gates  = r / S                           (T, k)
        share  = the tokens' share of first choices per expert        (E,)
        l_aux  = E * sum_e mean_t(scores[:, e]) * share[e]            GShard's (losses.gshard_loss)

    backward, dgates (T, k) and dl_aux:
        dr      = (dgates - [sum_j r >= eps] * sum_j dgates * gates) / S
        dscores = dr scattered to idx  +  dl_aux * E / T * share      (top-k indices are distinct)
        dlogits = softmax's backward of dscores

Other losses (``is_gshard_loss=False``) and the z-loss take the logits
through autograd beside this node. The scores carry no gradient (the flows
read them detached), and the node is differentiable once (no double
backward through the gate).

Logits on the CPU or a GPU take a2a's fused gate (``a2a.top_k_gate``): the
whole forward is one native call, and so is the backward, where the ops
above are fourteen and ten (each a launch on a GPU). It computes the same (in
its own order of summation; 16-bit logits in float32, rounded where the ops
round), and ranks the choices by the logits (the softmax's order, which a
16-bit score's rounding blurs), equal ones to the lower expert. Under
autocast, 16-bit logits take the ops above: autocast runs their softmax in
float32. (The layer runs its gate with autocast off: common/precision.py.)
"""

from __future__ import annotations

import torch

import a2a

from .losses import gshard_loss_and_share

__all__ = ["top_k_gating"]


def top_k_gating(logits: torch.Tensor, top_k: int, normalize: bool,
                 gshard_loss: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(scores, indices, gates, l_aux) of `logits` (T, E); l_aux is GShard's
    loss where `gshard_loss`, else None. See the module docstring."""
    device = logits.device.type
    fused = logits.dtype in _FUSED_DTYPES and device in _FUSED_DEVICES
    if fused and logits.dtype in _HALF_DTYPES and torch.is_autocast_enabled(device):
        fused = False  # autocast's softmax runs in float32: the ops give that
    if fused:  # a2a's node (a2a.torch.top_k_gate) where the logits record autograd
        scores, indices, gates, _, l_aux = a2a.top_k_gate(logits.contiguous(), top_k, normalize=normalize and top_k > 1)
        return scores, indices, gates, l_aux if gshard_loss else None
    return _TopKGating.apply(logits, top_k, normalize and top_k > 1, gshard_loss)


_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FUSED_DTYPES = (torch.float32, torch.float64, *_HALF_DTYPES)
_FUSED_DEVICES = ("cpu", "cuda")


class _TopKGating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, normalize: bool, gshard_loss: bool):
        scores = torch.softmax(logits, dim=1)
        top, indices = torch.topk(scores, top_k, dim=1)
        sums = denominators = None
        gates = top
        if normalize:
            sums = top.sum(dim=1, keepdim=True)
            denominators = sums.clamp(min=torch.finfo(top.dtype).eps)
            gates = top / denominators
        l_aux = share_per_token = None
        if gshard_loss:
            l_aux, share = gshard_loss_and_share(scores, indices)
            if share is not None:  # d l_aux / d scores[t, e], for every t
                num_tokens, num_experts = scores.shape
                share_per_token = share * (num_experts / num_tokens)
        ctx.mark_non_differentiable(scores, indices)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scores, indices, gates, sums, denominators, share_per_token)
        return scores, indices, gates, l_aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _scores, _indices, d_gates, d_l_aux):
        scores, indices, gates, sums, denominators, share_per_token = ctx.saved_tensors
        d_scores = torch.zeros_like(scores)
        if d_gates is not None:
            d_top = d_gates
            if denominators is not None:
                dot = (d_gates * gates).sum(dim=1, keepdim=True)
                dot.masked_fill_(sums < denominators, 0)  # the clamp held the denominator: no gradient through it
                d_top = (d_gates - dot) / denominators
            d_scores.scatter_(1, indices, d_top)
        if d_l_aux is not None and share_per_token is not None:
            d_scores.addcmul_(share_per_token, d_l_aux)
        # The softmax's own input dtype: under autocast it ran on the logits cast to float32 (autograd casts
        # the gradient back to the logits' dtype).
        return torch._softmax_backward_data(d_scores, scores, 1, scores.dtype), None, None, None
