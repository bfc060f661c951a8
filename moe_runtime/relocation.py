"""Moving whole experts between ranks for a new placement (MoELayer.place).

Every rank holds n experts in slots; physical position p = rank * n + slot.
``old`` and ``new`` map each logical expert to its position before and
after. An expert's rows of every tensor it owns (parameters, gradients,
optimizer state: each (n, ...) with the expert on dim 0) travel together as
one row of bytes::

    snapshot (n, B) uint8      this rank's experts, B = bytes of one expert in all tensors
    send     experts leaving, ordered by new position (so by destination rank)
    a2a.all_to_all_v           counts non-zero only between ranks that exchange experts:
                               point to point, each expert sent exactly once
    recv     ordered by source rank, then by new position (the sender's order)
    slot s <- snapshot row (expert stayed on this rank) or recv row (it arrived)

The tensors are written in place (copy_), so nn.Parameter objects and the
optimizer's references to them stay valid.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import a2a

__all__ = ["Moved", "move_experts", "placed_tensors"]


@dataclass(frozen=True)
class Moved:
    """What one rank sent: whole experts and their bytes (all tensors together)."""

    experts_sent: int
    bytes_sent: int


def placed_tensors(experts: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                   ) -> tuple[list[torch.Tensor], int]:
    """Every per-expert tensor a placement moves (the parameters of `experts`,
    their gradients, the optimizer state shaped like them) and a fingerprint
    of their structure and of the scalar state (e.g. Adam's step, shared by
    all experts of a parameter), which every rank must share."""
    held = set()
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tensors, described = [], []
    for name, parameter in experts.named_parameters():
        tensors.append(parameter)
        if parameter.grad is not None:
            tensors.append(parameter.grad)
        described.append((name, parameter.grad is not None))
        if optimizer is not None:
            if id(parameter) not in held:
                raise ValueError(f"the optimizer does not hold the expert parameter {name}; pass the optimizer "
                                 "that trains this layer (or none)")
            tensors += _per_expert_state(optimizer.state.get(parameter, {}), parameter, name, described)
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} among the expert parameters, gradients "
                             "and optimizer state is not contiguous: place moves contiguous tensors only")
    return tensors, zlib.crc32(repr(described).encode())


def _per_expert_state(state: dict, parameter: torch.Tensor, name: str, described: list) -> list[torch.Tensor]:
    """The optimizer state of `parameter` that moves (tensors of its shape);
    scalar state goes into `described` only."""
    moving = []
    for key, value in sorted(state.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == parameter.shape:
            moving.append(value)
            described.append((key, str(value.dtype)))
        elif isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            described.append((key, repr(float(value))))
        elif value is not None:
            raise ValueError(f"optimizer state {key!r} of {name} is neither per expert (shape "
                             f"{tuple(parameter.shape)}) nor a scalar: place cannot move it")
    return moving


def _bytes_of(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """(n, bytes per expert) uint8 view of a contiguous tensor with the experts on dim 0."""
    return tensor.detach().reshape(n, -1).view(torch.uint8)


def move_experts(tensors: Sequence[torch.Tensor], old: np.ndarray, new: np.ndarray, comm: a2a.Comm) -> Moved:
    """Collective: rearranges this rank's experts from positions `old` to `new`
    (E,) int64 (the same on every rank), each tensor (n, ...) contiguous and
    the same list, shapes and dtypes on every rank."""
    num_experts, rank = old.size, comm.rank
    n = num_experts // comm.size
    for tensor in tensors:
        if tensor.shape[:1] != (n,) or not tensor.is_contiguous():
            raise ValueError(f"move_experts on rank {rank}: every tensor must be contiguous (n={n}, ...), "
                             f"got {tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    if (old == new).all() or not tensors:
        return Moved(0, 0)
    old_rank, new_rank = old // n, new // n
    with torch.no_grad():
        snapshot = torch.cat([_bytes_of(t, n) for t in tensors], dim=1)  # (n, B)
        leaving = np.flatnonzero((old_rank == rank) & (new_rank != rank))
        leaving = leaving[np.argsort(new[leaving], kind="stable")]
        send_counts = np.bincount(new_rank[leaving], minlength=comm.size).astype(np.int64)
        rows = torch.from_numpy(old[leaving] % n).to(snapshot.device)
        send = snapshot.index_select(0, rows)
        if (old_rank != new_rank).any():  # the same decision on every rank: all call, or none
            received, _ = a2a.all_to_all_v(send.contiguous(), send_counts, comm=comm)
        else:
            received = send
        arriving = np.flatnonzero((new_rank == rank) & (old_rank != rank))
        arriving = arriving[np.lexsort((new[arriving], old_rank[arriving]))]  # source rank, then new position
        # slot -> row of cat(snapshot, received)
        source_row = np.empty(n, dtype=np.int64)
        staying = np.flatnonzero((new_rank == rank) & (old_rank == rank))
        source_row[new[staying] % n] = old[staying] % n
        source_row[new[arriving] % n] = n + np.arange(arriving.size)
        rearranged = torch.cat([snapshot, received]).index_select(0, torch.from_numpy(source_row).to(snapshot.device))
        offset = 0
        for tensor in tensors:
            view = _bytes_of(tensor, n)
            width = view.shape[1]
            view.copy_(rearranged[:, offset : offset + width])
            offset += width
    return Moved(int(leaving.size), int(leaving.size) * int(snapshot.shape[1]))
