"""Hexa-MoE's two flows (Section 3.3) over the expert-specific operators.

The experts are sharded along the hidden size (moe_runtime.hexa_experts);
tokens stay in their order and the ES operators (a2a.es_index, a2a.esmm,
a2a.ess, a2a.estmm) read each choice's expert through the re-index vector
of the routing, built once per call. An expert's FFN on a rank's tokens::

    h = esmm(x, fc1_w, index, bias=fc1_bias)                 token -> choice rows (T k, H)
    a = act(h)
    y = esmm(a, fc2_w, index, gates=gates, w_layout="kn")    choice -> token rows (T, M)
    y += sum_j gates[t, j] * fc2_bias[e_tj]                   (the bias, once)

model_centric (tensor parallelism): every rank's tokens, choices and gates
are all-gathered (all_gather_v: ranks may hold different numbers of
tokens); each rank runs the FFN above on all of them through its own hidden
slice (E, H_w, M) -- the partial outputs over the hidden slices sum to the
whole -- and reduce_scatter_v sums them back onto each rank's own tokens.
The backward is autograd's: the collectives' adjoints (all_gather_v <->
reduce_scatter_v) and the ES operators' (ESMM, ESS, ESTMM).

data_centric (data parallelism over sharded weights): the experts are
gathered whole into the pipeline-shared cache (moe_runtime.hexa_cache) and
each rank runs its own tokens through them. One autograd Function keeps
the inputs, the gates and the hidden activation, never the weights: its
backward gathers them again, computes the gradients with the ES operators
and reduce-scatters the weight gradients onto the shards.

In both, the fc2 bias (whole on every rank) gets its gradient all-reduced
in the backward, and the layer's weight-gradient scale (1/W for
expert_gradient="mean") is applied to the shards' gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import a2a
import a2a.torch as a2a_torch

from .activation import activate, activation_backward
from .hexa_cache import PipelineSharedCache
from .hexa_experts import HiddenShardedExperts, reduce_scatter_along_hidden

__all__ = ["DataCentric", "data_centric_moe", "fc2_bias_term", "model_centric_moe"]


class _ScaleGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _SumGradientOverRanks(torch.autograd.Function):
    """Identity whose backward all-reduces (sums) the gradient over the
    ranks and scales it: a replicated parameter's complete gradient."""

    @staticmethod
    def forward(ctx, x, comm, scale):
        ctx.comm, ctx.scale = comm, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        summed = a2a.all_reduce(grad.contiguous(), comm=ctx.comm)
        return summed.mul_(ctx.scale) if ctx.scale != 1.0 else summed, None, None


def fc2_bias_term(fc2_bias: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, comm: a2a.Comm,
                  scale: float) -> torch.Tensor:
    """(T, M): sum over each token's routed choices of gate * fc2_bias[expert],
    the bias added once per token; its gradient is summed over the ranks."""
    bias = _SumGradientOverRanks.apply(fc2_bias, comm, scale)
    routed = indices >= 0
    picked = bias[indices.clamp(min=0)]  # (T, k, M)
    weights = (gates * routed).to(picked.dtype).unsqueeze(-1)
    return (weights * picked).sum(dim=1)


def _gates_for(gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ES operators take gates in float32 or in the data's dtype."""
    return gates if gates.dtype in (torch.float32, dtype) else gates.to(dtype)


def model_centric_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *,
                      experts: HiddenShardedExperts, token_counts: Sequence[int], comm: a2a.Comm,
                      weight_grad_scale: float = 1.0) -> torch.Tensor:
    """y (T_w, M) of this rank's tokens (T_w = token_counts[rank]) through
    the experts sharded along H (see the module docstring)."""
    counts = [int(count) for count in token_counts]
    all_tokens = a2a_torch.all_gather_v(tokens, counts, comm=comm)
    all_gates = a2a_torch.all_gather_v(_gates_for(gates, tokens.dtype).contiguous(), counts, comm=comm)
    all_indices = a2a.all_gather_v(indices.contiguous(), counts, comm=comm)
    index = a2a.es_index(all_indices, experts.num_experts)
    fc1, fc1_bias, fc2 = experts.sharded_weights()
    if weight_grad_scale != 1.0:
        fc1, fc2 = _ScaleGradient.apply(fc1, weight_grad_scale), _ScaleGradient.apply(fc2, weight_grad_scale)
        if fc1_bias is not None:
            fc1_bias = _ScaleGradient.apply(fc1_bias, weight_grad_scale)
    hidden = a2a.esmm(all_tokens, fc1, index, bias=fc1_bias, x_rows="token", y_rows="choice", w_layout="nk")
    partial = a2a.esmm(experts.activation_fn(hidden), fc2, index, gates=all_gates, x_rows="choice",
                       y_rows="token", w_layout="kn")
    y = a2a_torch.reduce_scatter_v(partial, counts, comm=comm)
    if experts.batched_fc2_bias is not None:
        y = y + fc2_bias_term(experts.batched_fc2_bias, indices, gates, comm, weight_grad_scale)
    return y


@dataclass
class DataCentric:
    """What one data-centric call needs besides its tensors."""

    experts: HiddenShardedExperts
    cache: PipelineSharedCache
    token: int  # the layer's token in the cache
    comm: a2a.Comm  # the gathers' communicator
    index: a2a.ESIndex
    weight_grad_scale: float = 1.0


class _DataCentricExperts(torch.autograd.Function):
    """The experts whole (from the cache) on this rank's tokens; the
    backward gathers them again and reduce-scatters the weight gradients."""

    @staticmethod
    def forward(ctx, tokens, gates, fc1_shard, fc1_bias_shard, fc2_shard, call):
        fc1, fc1_bias, fc2 = call.cache.acquire(call.token, call.experts, call.comm)
        activation = call.experts.activation_fn
        hidden = a2a.esmm(tokens, fc1, call.index, bias=fc1_bias, x_rows="token", y_rows="choice", w_layout="nk")
        activated = activate(activation, hidden)  # relu: in place, `hidden` is its output
        y = a2a.esmm(activated, fc2, call.index, gates=gates, x_rows="choice", y_rows="token", w_layout="kn")
        ctx.call, ctx.with_fc1_bias = call, fc1_bias_shard is not None
        # Only the activations (relu's output, else the pre-activation:
        # moe_runtime.activation); the weights are gathered again in the backward.
        ctx.save_for_backward(tokens, gates, hidden)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        tokens, gates, kept = ctx.saved_tensors
        call = ctx.call
        experts, index = call.experts, call.index
        activation = experts.activation_fn
        fc1, _, fc2 = call.cache.acquire(call.token, experts, call.comm)  # the fc1 bias is not needed here
        grad_y = grad_y.contiguous()
        num_tokens, top_k = gates.shape
        # u_c = fc2[e_c] dy[t]: the gradient at choice c's activation, before its gate.
        ungated = a2a.esmm(grad_y, fc2, index, x_rows="token", y_rows="choice", w_layout="nk")
        flat_gates = gates.reshape(-1, 1).to(ungated.dtype)
        activated, grad_hidden = activation_backward(activation, kept, ungated * flat_gates)
        grad_gates = (ungated * activated).sum(dim=1).view(num_tokens, top_k).to(gates.dtype)
        del ungated
        split, comm, scale = experts.hidden_split, call.comm, call.weight_grad_scale
        grad_fc2_shard = _scatter(a2a.estmm(activated, grad_y, index, gates=gates, a_rows="choice", b_rows="token"),
                                  experts.batched_fc2_w, split, comm, scale)
        grad_fc1_shard = _scatter(a2a.estmm(grad_hidden, tokens, index, a_rows="choice", b_rows="token"),
                                  experts.batched_fc1_w, split, comm, scale)
        grad_fc1_bias_shard = None
        if ctx.with_fc1_bias:
            grad_fc1_bias_shard = _scatter(a2a.ess(grad_hidden, index, rows="choice"), experts.batched_fc1_bias,
                                           split, comm, scale)
        grad_tokens = a2a.esmm(grad_hidden, fc1, index, x_rows="choice", y_rows="token", w_layout="kn")
        return grad_tokens, grad_gates, grad_fc1_shard, grad_fc1_bias_shard, grad_fc2_shard, None


def _scatter(whole: torch.Tensor, shard: torch.Tensor, split: Sequence[int], comm: a2a.Comm,
             scale: float) -> torch.Tensor:
    """The shard's gradient: this rank's hidden rows of the sum over ranks of `whole`, scaled."""
    grad = reduce_scatter_along_hidden(whole.contiguous(), split, comm, torch.empty_like(shard))
    return grad.mul_(scale) if scale != 1.0 else grad


def data_centric_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *,
                     experts: HiddenShardedExperts, cache: PipelineSharedCache, token: int, comm: a2a.Comm,
                     weight_grad_scale: float = 1.0) -> torch.Tensor:
    """y (T, M) of this rank's tokens through the experts gathered whole
    into `cache` (see the module docstring); `token`: the layer's in the
    cache; `comm`: the gathers' communicator (every rank, the layer's own)."""
    index = a2a.es_index(indices.contiguous(), experts.num_experts)
    call = DataCentric(experts, cache, token, comm, index, weight_grad_scale)
    fc1, fc1_bias, fc2 = experts.sharded_weights()
    y = _DataCentricExperts.apply(tokens, _gates_for(gates, tokens.dtype).contiguous(), fc1, fc1_bias, fc2, call)
    if experts.batched_fc2_bias is not None:
        y = y + fc2_bias_term(experts.batched_fc2_bias, indices, gates, comm, weight_grad_scale)
    return y
