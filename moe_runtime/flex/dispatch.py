"""The dropless flow over vExpert replicas (FlexMoE): tokens go where
Algorithm 3's plan sends them, each rank computes its slots' rows, and the
replicas' gradients are all-reduced in the backward.

One call on rank g (W ranks, E experts, S slots per rank; ``sends`` (E, W,
W) from moe_runtime.flex.routing.route, the same on every rank)::

    tokens (T, M), indices (T, k)
    destination of each choice: expert e's choices on g, in a2a.permute's
        order (first choices before second ones), are cut into pieces of
        sends[e, g, 0], sends[e, g, 1], ... rows: piece h goes to rank h
    permute by (destination, expert), W E groups -> x_sorted (N, M):
        destination-major, then expert
    all_to_all_v (rows per destination) -> received (R, M): source-major,
        then expert; per_source[h, e] = sends[e, h, g] rows
    permute by slot: the rows of expert e go to the rank's first slot of e
        (its other slots of e share those weights; the paper's packing)
    FFN of each slot on its rows (ragged_ffn; weights (S, H, M) through
        the replica-gradient function below)
    unpermute, all_to_all_v back, unpermute with the gates -> y (T, M)

Backward: autograd runs the reverse flow; the slots' weight gradients come
out of ragged_ffn partial (each replica saw its own rows), and
:class:`ReplicaGradients` all-reduces each replicated expert's gradient
(its four tensors in one message) within the ranks holding it, in
ascending expert id on every rank, then copies it into the rank's other
slots of the expert. Every replica then holds the unreplicated layer's
gradient, and the same optimizer step keeps the replicas equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from ..common.host_values import uploaded
from ..experts.activation import Activation
from ..experts.ragged_ffn import ComputeClock, ExpertWeights, ragged_ffn
from .vexperts import SlotTable

__all__ = ["FlexCall", "ReplicaGradients", "destinations", "flex_moe"]


@dataclass
class FlexCall:
    """What one call measured on this rank, for the cost model
    (moe_runtime.flex.cost.StepSample): rows its slots computed, seconds of
    expert compute (forward + backward), of the two forward exchanges, and of
    each replica gradient all-reduce ({expert: seconds})."""

    rows: int
    compute: ComputeClock
    exchange_s: float = 0.0
    sync_s: dict[int, float] = field(default_factory=dict)
    backward_done: bool = False
    recorded: bool = True  # autograd recorded the call: its backward will complete the measurements


def destinations(indices: torch.Tensor, sends_from_me: np.ndarray) -> torch.Tensor:
    """(T, k) int64: destination rank * E + expert of each choice (see the
    module docstring); `sends_from_me` (E, W) rows of each expert to each rank."""
    num_experts = sends_from_me.shape[0]
    flat = indices.t().reshape(-1)  # a2a.permute's order: first choices before second ones
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    bounds = torch.from_numpy(np.cumsum(sends_from_me, axis=1)).to(flat.device)  # (E, W) piece ends
    rank = (bounds[flat] <= position.unsqueeze(1)).sum(dim=1)
    return (rank * num_experts + flat).view(indices.shape[1], indices.shape[0]).t().contiguous()


class ReplicaGradients(torch.autograd.Function):
    """Identity on the slot weights; its backward makes every replica's
    gradient the whole expert's (see the module docstring)."""

    @staticmethod
    def forward(ctx, sync, *weights):
        ctx.sync = sync
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.sync(grads))


@dataclass
class ReplicaSync:
    """The replica gradient all-reduce of one call: the table it ran with, the
    sub-communicators of its replica groups and where to record the times."""

    table: SlotTable
    rank: int
    groups: dict[tuple[int, ...], a2a.Comm]
    timer: Callable[[], float]
    call: FlexCall

    def __call__(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        slots = self.table.slots_per_rank
        grads = [g.contiguous() for g in grads]
        primary = self.table.primary_slots(self.rank)
        for expert, ranks in self.table.replica_groups():  # ascending expert id: the same sequence on every rank
            if self.rank not in ranks:
                continue
            j = int(primary[expert])
            flat = torch.cat([g[j].reshape(-1) for g in grads])
            start = self.timer()
            a2a.all_reduce(flat, comm=self.groups[ranks], out=flat)
            self.call.sync_s[expert] = self.timer() - start
            offset = 0
            for g in grads:
                width = g[j].numel()
                g[j].copy_(flat[offset : offset + width].view_as(g[j]))
                offset += width
        row = self.table.slots[self.rank]
        for j in range(slots):  # the rank's other slots of an expert: the first one's gradient
            if row[j] >= 0 and primary[row[j]] != j:
                for g in grads:
                    g[j].copy_(g[primary[row[j]]])
        self.call.backward_done = True
        return grads


def flex_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *, sends: np.ndarray,
             weights: ExpertWeights, sync: ReplicaSync, activation: Activation, comm: a2a.Comm, algo: str,
             weight_grad_scale: float = 1.0) -> torch.Tensor:
    """y (T, M) of this rank's tokens (see the module docstring). `weights`:
    this rank's slots (fc1 (S, H, M), fc1_bias (S, H) or None, fc2 (S, H, M),
    fc2_bias (S, M) or None); `sync` measures into its ``call``."""
    rank, ranks = comm.rank, comm.size
    num_experts = sends.shape[0]
    table, call, timer = sync.table, sync.call, sync.timer
    routed = destinations(indices, sends[:, rank, :])
    x_sorted, perm = a2a_torch.permute(tokens, routed, ranks * num_experts)
    send_counts = sends[:, rank, :].sum(axis=0)  # (W,) rows to each rank
    per_source = sends[:, :, rank].T  # (W, E): rows from each rank for each expert
    start = timer()
    received, _ = a2a_torch.all_to_all_v(x_sorted, send_counts, comm=comm, algo=algo)
    call.exchange_s += timer() - start

    # Received rows are source-major, then by expert; group them by this rank's first slot of each expert.
    primary = table.primary_slots(rank)
    expert_of_row = np.repeat(np.tile(np.arange(num_experts, dtype=np.int64), ranks), per_source.reshape(-1))
    slot_of_row = primary[expert_of_row]
    if (slot_of_row < 0).any():  # the plan sends an expert only to ranks holding it
        missing = sorted(set(expert_of_row[slot_of_row < 0].tolist()))
        raise RuntimeError(f"flex_moe on rank {rank}: rows arrived for experts {missing}, which no slot here serves")
    # Each slot's rows, known here: the local permutation needs no wait (every row routed, N = R).
    slot_offsets = [0, *np.cumsum(np.bincount(slot_of_row, minlength=table.slots_per_rank)).tolist()]
    slot_of_row = uploaded(torch.from_numpy(slot_of_row), received.device).view(-1, 1)  # no stream sync
    by_slot, slot_perm = a2a_torch.permute(received, slot_of_row, table.slots_per_rank, wait=False)
    present = [w for w in weights if w is not None]
    synced = iter(ReplicaGradients.apply(sync, *present))
    fc1, fc1_bias, fc2, fc2_bias = (None if w is None else next(synced) for w in weights)
    computed = ragged_ffn(by_slot, slot_offsets, fc1, fc1_bias, fc2, fc2_bias, activation,
                          weight_grad_scale, call.compute)
    back = a2a_torch.unpermute(computed, slot_perm)
    start = timer()
    returned, _ = a2a_torch.all_to_all_v(back, per_source.sum(axis=1), comm=comm, algo=algo)
    call.exchange_s += timer() - start
    return a2a_torch.unpermute(returned, perm, gates)
