"""Moving expert states between ranks: whole experts for a new placement
(MoELayer.place) and vExpert slots for FlexMoE's Expand and Migrate.

Every rank holds n slots; global slot p = rank * n + j. A slot's rows of
every tensor it owns (parameters, gradients, optimizer state: each (n, ...)
with the slot on dim 0) travel together as one row of bytes.
:func:`copy_slots` is the one mechanism: slot p takes the states slot
source[p] held before the call::

    snapshot (n, B) uint8      this rank's slots, B = bytes of one slot in all tensors
    send     source slots needed elsewhere, once per destination rank, ordered by
             destination rank then slot
    a2a.all_to_all_v           counts non-zero only between ranks that exchange slots:
                               point to point, one message per pair of ranks, all pairs at once
    recv     ordered by source rank, then slot (the senders' order)
    slot j <- snapshot row (source on this rank) or recv row (it arrived)

:func:`move_experts` (a permutation of whole experts, `old` and `new`
positions of each logical expert) is the case source[new[e]] = old[e].
The tensors are written in place (copy_), so nn.Parameter objects and the
optimizer's references to them stay valid.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import a2a

from ..common.host_values import all_gather_values

__all__ = ["Moved", "agree_on_move", "copy_slots", "move_experts", "placed_tensors"]


@dataclass(frozen=True)
class Moved:
    """What one rank sent: slots (whole experts) and their bytes (all tensors together)."""

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


def agree_on_move(comm: a2a.Comm, name: str, experts: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  describe: Callable[[], bytes], what: str) -> list[torch.Tensor]:
    """Collective check before moving expert states: `describe` (which may
    raise ValueError) returns what every rank must have asked for the same
    (an assignment, primitives), and every rank must pass an optimizer or
    none, with the same state structure. Returns placed_tensors' tensors;
    raises on every rank, naming the ranks, when any rank's request is
    invalid or differs from rank 0's; nothing moves then."""
    problem, digest, state_print, tensors = None, 0, 0, []
    try:
        digest = zlib.crc32(describe())
        tensors, state_print = placed_tensors(experts, optimizer)
    except ValueError as error:
        problem = f"{name}: {error}"
    row = np.array([problem is None, optimizer is not None, state_print, digest], dtype=np.int64)
    rows = all_gather_values(row, comm).reshape(comm.size, -1)
    if problem is not None:
        raise ValueError(problem)
    bad = np.flatnonzero(rows[:, 0] == 0).tolist()
    if bad:
        raise a2a.RemoteError(f"{name}: the {what} or optimizer of rank(s) {bad} is invalid (their error says "
                              "why); nothing moved")
    checks = ((3, what), (1, "optimizer (given or not)"),
              (2, "optimizer state (keys, dtypes, gradients or scalar state such as step)"))
    for column, described in checks:
        differ = np.flatnonzero(rows[:, column] != rows[0, column]).tolist()
        if differ:
            raise a2a.MismatchError(f"{name}: ranks {differ} passed a different {described} than rank 0; every "
                                    "rank must pass the same; nothing moved")
    return tensors


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
    source = np.full(old.size, -1, dtype=np.int64)
    moved = old != new
    source[new[moved]] = old[moved]
    return copy_slots(tensors, source, comm)


def copy_slots(tensors: Sequence[torch.Tensor], source: np.ndarray, comm: a2a.Comm) -> Moved:
    """Collective: slot p (global, rank * n + j) takes the rows of slot
    source[p] as they were before the call (-1: p keeps its own), in every
    tensor (n, ...) contiguous, the same list, shapes and dtypes on every
    rank; `source` (W n,) int64 is the same on every rank. A source slot
    needed on another rank is sent there once, whatever the slots it fills;
    all slots between two ranks travel in one message, and every pair at once
    (one all_to_all_v, when any slot changes rank)."""
    rank = comm.rank
    n = source.size // comm.size
    for tensor in tensors:
        if tensor.shape[:1] != (n,) or not tensor.is_contiguous():
            raise ValueError(f"copy_slots on rank {rank}: every tensor must be contiguous (n={n}, ...), "
                             f"got {tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    if not (source >= 0).any() or not tensors:
        return Moved(0, 0)
    destinations = np.flatnonzero(source >= 0)
    sources = source[destinations]
    crossing = sources // n != destinations // n
    # (destination rank, source slot) of each slot sent, once per pair, by destination rank then slot.
    sent = np.unique(np.stack([destinations[crossing] // n, sources[crossing]], axis=1), axis=0).reshape(-1, 2)
    with torch.no_grad():
        snapshot = torch.cat([_bytes_of(t, n) for t in tensors], dim=1)  # (n, B)
        mine = sent[sent[:, 1] // n == rank]
        send_counts = np.bincount(mine[:, 0], minlength=comm.size).astype(np.int64)
        send = snapshot.index_select(0, torch.from_numpy(mine[:, 1] % n).to(snapshot.device))
        if crossing.any():  # the same decision on every rank: all call, or none
            received, _ = a2a.all_to_all_v(send.contiguous(), send_counts, comm=comm)
        else:
            received = send
        # What arrives: the slots sent to this rank, by source rank then slot (their senders' order).
        arriving = sent[sent[:, 0] == rank, 1]
        arriving = arriving[np.argsort(arriving, kind="stable")]
        row_of_arrival = {int(slot): n + i for i, slot in enumerate(arriving.tolist())}
        here = destinations // n == rank
        source_row = np.arange(n, dtype=np.int64)  # slot j <- row of cat(snapshot, received)
        for destination, origin in zip(destinations[here].tolist(), sources[here].tolist()):
            source_row[destination % n] = origin % n if origin // n == rank else row_of_arrival[origin]
        rearranged = torch.cat([snapshot, received]).index_select(0, torch.from_numpy(source_row).to(snapshot.device))
        offset = 0
        for tensor in tensors:
            view = _bytes_of(tensor, n)
            width = view.shape[1]
            view.copy_(rearranged[:, offset : offset + width])
            offset += width
    return Moved(int(mine.shape[0]), int(mine.shape[0]) * int(snapshot.shape[1]))
