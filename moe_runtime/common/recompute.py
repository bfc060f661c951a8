"""Activation checkpointing: a forward that the backward runs again.

torch.utils.checkpoint (either variant), Megatron's and DeepSpeed's
checkpointing run a layer's forward twice: once in the forward pass (with
autograd, or under no_grad for the reentrant variants) and once more inside
the backward, to rebuild what it saved. The second run must decide what the
first decided, or its saved tensors differ from the graph they rebuild
(non-reentrant torch raises CheckpointError), and it must not count as a
new call, or whatever learns from calls learns each one twice:

    forward   decides from the layer's state (a dynamic capacity, the
              dictionary's trial), updates that state, keeps the decision
              here under the call's key
    ...       other calls: other layers, other micro-batches
    backward  recomputation: recomputing() is True; takes the kept decision
              by the same key and updates nothing

A key is made of host values the recomputation sees again (agreed counts
and a checksum of the routing, the capacity, the sample ids). Micro-batches
in flight together may share a key (equal capacities): where their decisions
differ, a mark kept beside each (a checksum of the call's tokens) tells them
apart, agreed across ranks so that every rank takes the same; each decision
is taken once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numpy as np
import torch

__all__ = ["KeptDecisions", "recomputing", "trace_routing"]

Value = TypeVar("Value")

# Calls of one layer whose decisions are kept: more than any pipeline schedule has in flight.
KEPT_CALLS = 256


def recomputing() -> bool:
    """Whether this forward is a recomputation: autograd records it while its
    engine runs a backward (a layer's forward runs there only to be recomputed)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class KeptDecisions(Generic[Value]):
    """One layer's decisions of its last forwards (at most ``limit``), for
    their recomputations."""

    def __init__(self, limit: int = KEPT_CALLS):
        self._calls: deque[tuple[Hashable, Value]] = deque(maxlen=limit)

    def keep(self, key: Hashable, value: Value) -> None:
        """A forward's decision; the oldest kept goes when ``limit`` are."""
        self._calls.append((key, value))

    def take(self, key: Hashable, pick: Callable[[list[Value]], int | None] | None = None) -> Value | None:
        """The decision kept under `key`, no longer kept; None when none is
        (its forward was too long ago, or decided nothing here). Where several
        are, pick(those, newest first) says which (asked only then); None
        from it: they are alike, and the newest's value serves, left kept
        (it may be another call's, which would then lose its own)."""
        found = [i for i in range(len(self._calls) - 1, -1, -1) if self._calls[i][0] == key]
        if not found:
            return None
        chosen = pick([self._calls[i][1] for i in found]) if len(found) > 1 and pick is not None else 0
        if chosen is None:
            return self._calls[found[0]][1]
        value = self._calls[found[chosen]][1]
        del self._calls[found[chosen]]
        return value

    def __len__(self) -> int:
        return len(self._calls)


def trace_routing(trace: list[np.ndarray] | None, indices: torch.Tensor, num_experts: int) -> None:
    """Appends a call's routed counts per expert (E,) to ``layer.routing_trace``
    (None: not traced); a recomputation is not a new call."""
    if trace is not None and not recomputing():
        trace.append(torch.bincount(indices.reshape(-1), minlength=num_experts).cpu().numpy())
