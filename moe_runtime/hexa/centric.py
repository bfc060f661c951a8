"""Hexa-MoE's two flows (Section 3.3) over the expert-specific operators.

The experts are sharded along the hidden size (moe_runtime.hexa.experts,
``MoELayer(flow="data_centric" | "model_centric")``), or held whole n per rank in Tutel's layout
(moe_runtime.experts.ffn, when the dictionary of an expert-parallel layer picks
one of these flows: the layer's ``flows=``); each flow asks the layout for
what it needs (:class:`HexaLayout`). Tokens stay in their order and the ES operators (a2a.es_index, a2a.esmm,
a2a.ess, a2a.estmm) read each choice's expert through the re-index vector
of the routing, built once per call. An expert's FFN on a rank's tokens::

    h = esmm(x, fc1_w, index, bias=fc1_bias)                 token -> choice rows (T k, H)
    a = act(h)
    y = esmm(a, fc2_w, index, gates=gates, w_layout="kn")    choice -> token rows (T, M)
    y += sum_j gates[t, j] * fc2_bias[e_tj]                   (the bias, once)

model_centric (tensor parallelism): every rank's tokens, choices and gates
are all-gathered (all_gather_v: ranks may hold different numbers of
tokens); each rank runs the FFN above on all of them through its own hidden
slice (E, H_w, M) (``hidden_slices``: the shards, or an all-to-all of
Tutel's whole experts) -- the partial outputs over the hidden slices sum to the
whole -- and reduce_scatter_v sums them back onto each rank's own tokens.
The backward is autograd's: the collectives' adjoints (all_gather_v <->
reduce_scatter_v) and the ES operators' (ESMM, ESS, ESTMM).

data_centric (data parallelism over sharded weights): the experts are
gathered whole into the pipeline-shared cache (moe_runtime.hexa.cache;
``gather_whole``) and each rank runs its own tokens through them. One
autograd Function keeps the inputs, the gates and the hidden activation,
never the weights: its backward gathers them again, computes the gradients
with the ES operators and reduce-scatters the weight gradients onto the
shards (``reduce_scatter_whole``).

In both, the fc2 bias comes whole from the layout (``fc2_bias``: the
replicated parameter with its gradient all-reduced, or an all-gather of
Tutel's shards whose backward reduce-scatters it), and the layer's
weight-gradient scale (1/W for expert_gradient="mean") is applied to the
shards' gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

import a2a
import a2a.torch as a2a_torch

from ..experts.activation import activate, activation_backward
from ..experts.grouped import grouped_gemms_run
from .cache import GatheredLayout, PipelineSharedCache, scatter_gradient
from .rows import data_centric_rows, model_centric_rows

__all__ = ["KERNELS", "HexaLayout", "data_centric_moe", "fc2_bias_term", "model_centric_moe", "on_rows"]


class HexaLayout(GatheredLayout, Protocol):
    """What the two flows need of an expert layout, besides what the cache
    needs (moe_runtime.hexa.experts.HiddenShardedExperts, moe_runtime.experts.ffn.FFNExperts)."""

    activation_fn: Callable[[torch.Tensor], torch.Tensor]
    batched_fc2_w: torch.Tensor

    def hidden_slices(self, comm: a2a.Comm) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's hidden slice of every expert (fc1_w, fc1_bias, fc2_w), with autograd to the shards."""

    def fc2_bias(self, comm: a2a.Comm) -> torch.Tensor | None:
        """The whole fc2 bias (E, M), with autograd to the shards (their gradient complete)."""


class _ScaleGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def fc2_bias_term(bias: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """(T, M): sum over each token's routed choices of gate * bias[expert]
    (bias (E, M) whole), the fc2 bias added once per token."""
    routed = indices >= 0
    picked = bias[indices.clamp(min=0)]  # (T, k, M)
    weights = (gates * routed).to(picked.dtype).unsqueeze(-1)
    return (weights * picked).sum(dim=1)


def _gates_for(gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ES operators take gates in float32 or in the data's dtype."""
    return gates if gates.dtype in (torch.float32, dtype) else gates.to(dtype)


def _scaled(tensor: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """`tensor` whose gradient is multiplied by `scale` (the collectives between it and the shards are linear)."""
    return tensor if tensor is None or scale == 1.0 else _ScaleGradient.apply(tensor, scale)


# How the flows compute the experts: "es", a2a's expert-specific operators
# on the tokens in their order (Hexa-MoE's); "grouped", the FFN on rows
# grouped by expert (rows.py: torch's grouped GEMM where it runs, else
# expert after expert); "auto", grouped where torch's grouped GEMM takes the
# tokens' device, dtype and widths, else es.
KERNELS = ("auto", "es", "grouped")


def on_rows(kernels: str, tokens: torch.Tensor, hidden: int) -> bool:
    """Whether a call with `kernels` (KERNELS) computes on rows grouped by
    expert, for experts of `hidden` units (a rank's slice of them, or whole)."""
    if kernels != "auto":
        return kernels == "grouped"
    return grouped_gemms_run(tokens.device, tokens.dtype, tokens.shape[-1], hidden)


def _with_fc2_bias(y: torch.Tensor, experts: HexaLayout, indices: torch.Tensor, gates: torch.Tensor,
                   comm: a2a.Comm, scale: float) -> torch.Tensor:
    bias = experts.fc2_bias(comm)
    return y if bias is None else y + fc2_bias_term(_scaled(bias, scale), indices, gates)


def model_centric_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *,
                      experts: HexaLayout, token_counts: Sequence[int], comm: a2a.Comm,
                      weight_grad_scale: float = 1.0, kernels: str = "auto") -> torch.Tensor:
    """y (T_w, M) of this rank's tokens (T_w = token_counts[rank]) through
    this rank's hidden slice of every expert (see the module docstring).
    `kernels`: see :func:`on_rows`."""
    counts = [int(count) for count in token_counts]
    all_tokens = a2a_torch.all_gather_v(tokens, counts, comm=comm)
    all_gates = a2a_torch.all_gather_v(_gates_for(gates, tokens.dtype).contiguous(), counts, comm=comm)
    all_indices = a2a.all_gather_v(indices.contiguous(), counts, comm=comm)
    fc1, fc1_bias, fc2 = (_scaled(t, weight_grad_scale) for t in experts.hidden_slices(comm))
    if on_rows(kernels, tokens, fc1.shape[1]):
        partial = model_centric_rows(all_tokens, all_indices, all_gates, fc1, fc1_bias, fc2, experts.activation_fn)
    else:
        index = a2a.es_index(all_indices, experts.num_experts)
        hidden = a2a.esmm(all_tokens, fc1, index, bias=fc1_bias, x_rows="token", y_rows="choice", w_layout="nk")
        partial = a2a.esmm(experts.activation_fn(hidden), fc2, index, gates=all_gates, x_rows="choice",
                           y_rows="token", w_layout="kn")
    y = a2a_torch.reduce_scatter_v(partial, counts, comm=comm)
    return _with_fc2_bias(y, experts, indices, gates, comm, weight_grad_scale)


@dataclass
class DataCentricCall:
    """What one data-centric call needs besides its tensors."""

    experts: HexaLayout
    cache: PipelineSharedCache
    token: int  # the layer's token in the cache
    comm: a2a.Comm  # the gathers' communicator
    index: a2a.ESIndex | None  # None on rows grouped by expert (rows.py)
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
        # moe_runtime.experts.activation); the weights are gathered again in the backward.
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
        comm, scale = call.comm, call.weight_grad_scale
        grad_fc2_whole = a2a.estmm(activated, grad_y, index, gates=gates, a_rows="choice", b_rows="token")
        grad_fc2_shard = scatter_gradient(grad_fc2_whole, experts, experts.batched_fc2_w, comm, scale)
        grad_fc1_whole = a2a.estmm(grad_hidden, tokens, index, a_rows="choice", b_rows="token")
        grad_fc1_shard = scatter_gradient(grad_fc1_whole, experts, experts.batched_fc1_w, comm, scale)
        grad_fc1_bias_shard = None
        if ctx.with_fc1_bias:
            grad_fc1_bias_shard = scatter_gradient(a2a.ess(grad_hidden, index, rows="choice"), experts,
                                                   experts.batched_fc1_bias, comm, scale)
        grad_tokens = a2a.esmm(grad_hidden, fc1, index, x_rows="choice", y_rows="token", w_layout="kn")
        return grad_tokens, grad_gates, grad_fc1_shard, grad_fc1_bias_shard, grad_fc2_shard, None


def data_centric_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *,
                     experts: HexaLayout, cache: PipelineSharedCache, token: int, comm: a2a.Comm,
                     weight_grad_scale: float = 1.0, kernels: str = "auto") -> torch.Tensor:
    """y (T, M) of this rank's tokens through the experts gathered whole
    into `cache` (see the module docstring); `token`: the layer's in the
    cache; `comm`: the gathers' communicator (every rank, the layer's own).
    `kernels`: see :func:`on_rows`."""
    gates_in = _gates_for(gates, tokens.dtype).contiguous()
    if on_rows(kernels, tokens, experts.hidden_size):
        call = DataCentricCall(experts, cache, token, comm, None, weight_grad_scale)
        y = data_centric_rows(tokens, indices, gates_in, call, experts.sharded_weights())
        return _with_fc2_bias(y, experts, indices, gates, comm, weight_grad_scale)
    index = a2a.es_index(indices.contiguous(), experts.num_experts)
    call = DataCentricCall(experts, cache, token, comm, index, weight_grad_scale)
    fc1, fc1_bias, fc2 = experts.sharded_weights()
    y = _DataCentricExperts.apply(tokens, gates_in, fc1, fc1_bias, fc2, call)
    return _with_fc2_bias(y, experts, indices, gates, comm, weight_grad_scale)
