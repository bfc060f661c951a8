"""Hexa-MoE's expert layout (Section 3.3): every expert sharded along its
hidden size H over all W ranks.

Rank w holds hidden units [o_w, o_w + H_w) of every expert, o_w = H_0 + ...
+ H_{w-1}; the H_w come from ``hidden_split`` (uniform by default, or
:func:`moe_runtime.hexa.split.split_by_latency` of the ranks' measured
latencies, Equation 2)::

    batched_fc1_w     (E, H_w, M)
    batched_fc1_bias  (E, H_w)        if has_fc1_bias
    batched_fc2_w     (E, H_w, M)
    batched_fc2_bias  (E, M)          if has_fc2_bias: whole on every rank

The fc2 bias is not split: it acts on the output, which the hidden units sum
into. Every rank holds it whole (the same values, replicated: tagged
``REPLICATED_TAG``, the layer gives it rank 0's values at construction,
moe_runtime.experts.replicas, whatever each rank's expert seed) and the layer
all-reduces its gradient in the backward, so that every rank's copy gets the
same, complete gradient and stays equal under any optimizer; it carries the
expert tag all the same (moe_runtime.sync_shared_gradients leaves it alone).

E comes from the experts dictionary as for the other layouts (E = n W, or
W / s for n = -s), and every expert is drawn from its own generator
(experts.draw_expert), so the model is the same as the expert-parallel
layer's with the same seeds, whatever W and the split.

The flows gather a whole expert tensor along H, one collective per expert
(an expert's (H, M) block is the ranks' (H_w, M) blocks one after the other,
what a2a.all_gather_v writes), and reduce-scatter gradients the same way.
Those are the methods the Hexa-MoE flows (moe_runtime.hexa.centric) and the
pipeline-shared cache call on a layout: ``gather_whole`` /
``reduce_scatter_whole`` (data-centric), ``hidden_slices`` (model-centric:
here the shards themselves) and ``fc2_bias`` (the whole bias, with its
gradient summed over the ranks). Tutel's layout (moe_runtime.experts.ffn.
FFNExperts) has the same methods, so either flow runs on either layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import a2a

from ..common.host_values import all_gather_values
from ..experts.ffn import EXPERT_TAG, check_ffn_spec, draw_expert, expert_layout
from ..experts.replicas import REPLICATED_TAG
from .split import offsets, uniform_split

__all__ = ["HiddenShardedExperts", "agreed_hidden_split", "check_hidden_split", "gather_along_hidden",
           "reduce_scatter_along_hidden"]

SHARDED_NAMES = ("batched_fc1_w", "batched_fc1_bias", "batched_fc2_w")  # split along H
WHOLE_NAMES = ("batched_fc2_bias",)  # whole on every rank


def check_hidden_split(split: Sequence[int] | None, hidden: int, world: int) -> tuple[int, ...]:
    """The hidden split (H_0, ..., H_{W-1}): `split` checked (W positive
    integers summing to H), or the uniform one for None."""
    if split is None:
        if hidden < world:
            raise ValueError(f"hidden_size_per_expert={hidden} is smaller than the {world} ranks: every rank of a "
                             "data- or model-centric layer holds at least one hidden unit of each expert")
        return tuple(uniform_split(hidden, world))
    try:
        parts = list(split)
    except TypeError as error:
        raise ValueError(f"hidden_split must be a sequence of {world} positive integers, got {split!r}") from error
    if len(parts) != world or not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in parts):
        raise ValueError(f"hidden_split must give one integer per rank ({world}), got {parts!r}")
    parts = [int(part) for part in parts]
    if any(part < 1 for part in parts):
        raise ValueError(f"hidden_split {parts}: every rank must hold at least one hidden unit (a part of 0 would "
                         "leave that rank's shards empty)")
    if sum(parts) != hidden:
        raise ValueError(f"hidden_split {parts} sums to {sum(parts)}, not hidden_size_per_expert={hidden}")
    return tuple(parts)


def gather_along_hidden(shard: torch.Tensor, split: Sequence[int], comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
    """`out` (E, H, ...) <- every rank's `shard` (E, H_w, ...) along dim 1
    (collective; one all_gather_v per expert, straight into `out`)."""
    for expert in range(shard.shape[0]):
        a2a.all_gather_v(shard[expert], split, comm=comm, out=out[expert])
    return out


def reduce_scatter_along_hidden(whole: torch.Tensor, split: Sequence[int], comm: a2a.Comm,
                                out: torch.Tensor) -> torch.Tensor:
    """`out` (E, H_w, ...) <- this rank's hidden rows of the sum over ranks of
    `whole` (E, H, ...) (collective; one reduce_scatter_v per expert)."""
    for expert in range(whole.shape[0]):
        a2a.reduce_scatter_v(whole[expert], split, comm=comm, out=out[expert])
    return out


class _SumGradientOverRanks(torch.autograd.Function):
    """Identity whose backward all-reduces (sums) the gradient over the
    ranks: a replicated parameter's complete gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return a2a.all_reduce(grad.contiguous(), comm=ctx.comm), None


class HiddenShardedExperts(torch.nn.Module):
    """This rank's hidden slice of every expert (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], model_dim: int, comm: a2a.Comm, expert_seed: int,
                 hidden_split: Sequence[int] | None = None):
        super().__init__()
        hidden = check_ffn_spec(spec)
        self.num_experts = expert_layout(spec, comm.size)[0]
        self.rank, self.world_size = comm.rank, comm.size
        self.model_dim, self.hidden_size = model_dim, hidden
        self.hidden_split = agreed_hidden_split(comm, hidden_split, hidden)
        starts = offsets(self.hidden_split)
        self.hidden_start, self.hidden_stop = starts[comm.rank], starts[comm.rank + 1]
        self.activation_fn: Callable[[torch.Tensor], torch.Tensor] = spec.get("activation_fn") or F.relu
        experts, local = self.num_experts, self.hidden_split[comm.rank]
        self.batched_fc1_w = torch.nn.Parameter(torch.empty(experts, local, model_dim))
        self.batched_fc2_w = torch.nn.Parameter(torch.empty(experts, local, model_dim))
        self.batched_fc1_bias = (
            torch.nn.Parameter(torch.empty(experts, local)) if spec.get("has_fc1_bias", True) else None
        )
        self.batched_fc2_bias = (
            torch.nn.Parameter(torch.empty(experts, model_dim)) if spec.get("has_fc2_bias", True) else None
        )
        for parameter in self.parameters():
            setattr(parameter, EXPERT_TAG, True)
        if self.batched_fc2_bias is not None:  # whole on every rank: the layer makes it rank 0's (experts.replicas)
            setattr(self.batched_fc2_bias, REPLICATED_TAG, True)
        self.reset_parameters(expert_seed)

    @property
    def local_hidden(self) -> int:
        """H_w: the hidden units of each expert this rank holds."""
        return self.hidden_split[self.rank]

    def reset_parameters(self, expert_seed: int) -> None:
        """Draws every expert whole and keeps this rank's hidden rows."""
        rows = slice(self.hidden_start, self.hidden_stop)
        with torch.no_grad():
            for expert in range(self.num_experts):
                fc1, fc1_bias, fc2, fc2_bias = draw_expert(expert_seed, expert, self.hidden_size, self.model_dim)
                self.batched_fc1_w[expert].copy_(fc1[rows])
                self.batched_fc2_w[expert].copy_(fc2[rows])
                if self.batched_fc1_bias is not None:
                    self.batched_fc1_bias[expert].copy_(fc1_bias[rows])
                if self.batched_fc2_bias is not None:
                    self.batched_fc2_bias[expert].copy_(fc2_bias)

    def sharded_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's (fc1_w, fc1_bias or None, fc2_w), as stored."""
        return self.batched_fc1_w, self.batched_fc1_bias, self.batched_fc2_w

    def hidden_slices(self, comm: a2a.Comm) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's hidden slice of every expert, (fc1_w (E, H_w, M),
        fc1_bias (E, H_w) or None, fc2_w (E, H_w, M)): the shards themselves."""
        return self.sharded_weights()

    def fc2_bias(self, comm: a2a.Comm) -> torch.Tensor | None:
        """The whole fc2 bias (E, M), the replicated parameter, whose gradient
        is summed over the ranks of `comm` (every rank's copy gets it whole)."""
        if self.batched_fc2_bias is None:
            return None
        return _SumGradientOverRanks.apply(self.batched_fc2_bias, comm)

    def gather_whole(self, shard: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` (E, H, ...) <- every rank's `shard` (E, H_w, ...) of one split
        tensor (collective, no autograd)."""
        return gather_along_hidden(shard, self.hidden_split, comm, out)

    def reduce_scatter_whole(self, whole: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` (E, H_w, ...) <- this rank's hidden rows of the sum over ranks
        of `whole` (E, H, ...): a whole tensor's gradient onto the shard."""
        return reduce_scatter_along_hidden(whole, self.hidden_split, comm, out)

    def gather_experts(self, comm: a2a.Comm, *, grad: bool = False) -> dict[str, torch.Tensor]:
        """Every expert whole, on every rank (collective, no autograd), with
        Tutel's names and shapes ((E, H, M), (E, H), (E, M)); their
        gradients with grad=True (zeros where a parameter has none)."""
        whole = {}
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                tensor = parameter
                if grad:
                    tensor = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                if name in WHOLE_NAMES:
                    whole[name] = tensor.detach().clone()
                    continue
                out = tensor.new_empty((self.num_experts, self.hidden_size, *tensor.shape[2:]))
                whole[name] = gather_along_hidden(tensor.detach().contiguous(), self.hidden_split, comm, out)
        return whole

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden_size={self.hidden_size}, "
                f"hidden_split={list(self.hidden_split)}")


def agreed_hidden_split(comm: a2a.Comm, split: Sequence[int] | None, hidden: int) -> tuple[int, ...]:
    """The hidden split, checked on every rank and agreed (collective: one
    small all-gather): a split that is wrong on some rank, or that differs
    between ranks, raises on every rank (ValueError, MismatchError)."""
    world = comm.size
    row = np.zeros(world + 1, dtype=np.int64)  # [valid, H_0, ..., H_{W-1}]
    error = None
    try:
        parts = check_hidden_split(split, hidden, world)
        row[0], row[1:] = 1, parts
    except ValueError as caught:
        error = caught
    table = all_gather_values(row, comm).reshape(world, world + 1)
    if error is not None:
        raise error
    invalid = np.flatnonzero(table[:, 0] == 0).tolist()
    if invalid:
        raise ValueError(f"hidden_split on rank {comm.rank}: rank(s) {invalid} passed an invalid hidden split "
                         "(their error names it)")
    if (table[:, 1:] != table[0, 1:]).any():
        shown = "; ".join(f"rank {rank}: {table[rank, 1:].tolist()}" for rank in range(world))
        raise a2a.MismatchError(f"hidden_split on rank {comm.rank}: the ranks passed different hidden splits "
                                f"({shown}); every rank must pass the same")
    return parts
