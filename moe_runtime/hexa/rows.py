"""Hexa-MoE's flows with the experts on rows grouped by expert: the vendor's
grouped GEMMs in place of the expert-specific operators (centric.py).

The same FFN of every routed choice, computed another way::

    rows, perm = a2a.permute(x, indices, E)     (N, M): the choices' tokens, expert by expert
    out = every expert's FFN on its rows        (N, M): moe_runtime.experts.ragged_ffn, as
                                                torch's grouped GEMM where it runs (grouped.py),
                                                else expert after expert
    y = a2a.unpermute(out, perm, gates)         (T, M): each token's gate-weighted sum

where the ES operators read every expert's tokens in place through the
re-index vector, in a2a's own kernels. The ES path counts one host wait per
call (es_index's slots); the rows path none where the grouped GEMMs take the
rows (a2a.permute(..., wait=False): T*k rows, the experts' offsets on the
device), else one (permute's counts, for the loop over the experts). Where torch's grouped GEMM runs, its
matmuls are the vendor's: on the H200 a2a's bfloat16 ``esmm`` ran at 0.10-0.13
of a cuBLAS matmul of the same FLOPs (docs/benchmarks.md), and on this
project's CPU the grouped path took 0.45-0.85 of the ES path's time
(float32 and bfloat16, T = 1024-4096, M = H = 256-512, E = 8, top-2). The
price is memory: the backward keeps the permuted rows (N, M) and, for the
gate gradient, the experts' outputs (N, M) besides the hidden activations,
where the ES path keeps the tokens (T, M). The values agree with the ES
path's to rounding (each choice's output is rounded to the dtype before the
gate-weighted sum, which the ES path makes from float32).

model_centric: autograd through permute, ragged_ffn and unpermute on this
rank's hidden slices. data_centric: the experts whole from the pipeline-
shared cache, as in centric.py, by a Function that keeps the rows and the
hidden activations but never the weights: its backward gathers them again
and reduce-scatters the weight gradients onto the shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from ..experts.activation import Activation
from ..experts.grouped import grouped_gemms_take
from ..experts.ragged_ffn import ragged_backward, ragged_ffn, ragged_forward
from .cache import scatter_gradient

__all__ = ["data_centric_rows", "model_centric_rows"]


def _permuted(tokens: torch.Tensor, indices: torch.Tensor, num_experts: int,
              grouped: bool) -> tuple[torch.Tensor, a2a.Routing, list[int] | torch.Tensor]:
    """(rows, perm, each expert's first row and the end) of the choices: where the grouped GEMMs take
    the rows (`grouped`), permute without a wait and the offsets on the device (the GEMMs read them
    there); else permute's counts, known on the host, for the loop over the experts."""
    rows, perm = a2a_torch.permute(tokens, indices.contiguous(), num_experts, wait=not grouped)
    return rows, perm, perm.offsets if grouped else [0, *np.cumsum(perm.host_counts).tolist()]


def model_centric_rows(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, fc1: torch.Tensor,
                       fc1_bias: torch.Tensor | None, fc2: torch.Tensor, activation: Activation) -> torch.Tensor:
    """(T, M): sum over each token's choices of gate * FFN of its expert, with
    the experts' weights fc1, fc2 (E, H, M) and fc1_bias (E, H) or None (no
    fc2 bias: the caller adds it once); differentiable."""
    # The permuted rows keep the tokens' width, dtype and device.
    rows, perm, offsets = _permuted(tokens, indices, fc1.shape[0], grouped_gemms_take(tokens, fc1.shape[1], fc1, fc2))
    out = ragged_ffn(rows, offsets, fc1, fc1_bias, fc2, None, activation)
    return a2a_torch.unpermute(out, perm, gates)


class _CachedRowsExperts(torch.autograd.Function):
    """The experts whole (from the cache) on the permuted rows; the backward
    gathers them again and reduce-scatters the weight gradients."""

    @staticmethod
    def forward(ctx, rows, fc1_shard, fc1_bias_shard, fc2_shard, call, offsets):
        fc1, fc1_bias, fc2 = call.cache.acquire(call.token, call.experts, call.comm)
        out, hidden, how = ragged_forward(rows, offsets, fc1, fc1_bias, fc2, None, call.experts.activation_fn)
        ctx.save_for_backward(rows, hidden)
        ctx.call, ctx.how, ctx.with_fc1_bias = call, how, fc1_bias_shard is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        rows, hidden = ctx.saved_tensors
        call = ctx.call
        experts = call.experts
        fc1, _, fc2 = call.cache.acquire(call.token, experts, call.comm)  # the fc1 bias is not needed here
        grad_rows, grad_fc1, grad_fc1_bias, grad_fc2, _ = ragged_backward(
            ctx.how, grad_out.contiguous(), rows, hidden, fc1, fc2, experts.activation_fn, 1.0,
            (ctx.with_fc1_bias, False))
        comm, scale = call.comm, call.weight_grad_scale
        # In the ES path's order (fc2, fc1, fc1 bias): every rank reduce-scatters alike.
        grad_fc2_shard = scatter_gradient(grad_fc2, experts, experts.batched_fc2_w, comm, scale)
        grad_fc1_shard = scatter_gradient(grad_fc1, experts, experts.batched_fc1_w, comm, scale)
        grad_fc1_bias_shard = None
        if ctx.with_fc1_bias:
            grad_fc1_bias_shard = scatter_gradient(grad_fc1_bias, experts, experts.batched_fc1_bias, comm, scale)
        return grad_rows, grad_fc1_shard, grad_fc1_bias_shard, grad_fc2_shard, None, None


def data_centric_rows(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, call: Any,
                      shards: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """(T, M) of this rank's tokens through the experts gathered whole into
    the cache (no fc2 bias: the caller adds it once). `call`: the
    data-centric call (centric.DataCentricCall: experts, cache, token, comm,
    weight_grad_scale); `shards`: this rank's (fc1, fc1_bias or None, fc2)."""
    fc1, fc1_bias, fc2 = shards
    experts = call.experts
    # The whole experts, as the cache holds them: contiguous, in the shards' dtype.
    grouped = grouped_gemms_take(tokens, experts.hidden_size, fc1)
    rows, perm, offsets = _permuted(tokens, indices, experts.num_experts, grouped)
    out = _CachedRowsExperts.apply(rows, fc1, fc1_bias, fc2, call, offsets)
    return a2a_torch.unpermute(out, perm, gates)
