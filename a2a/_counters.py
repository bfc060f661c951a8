"""What calls cost: ``a2a.counters()`` and ``a2a.counting()`` (README, "What calls cost: counters").

The core counts, per communicator and for the process, where each cost is
paid (a2a.h, ``a2a_counters_t``): rounds and point-to-point messages on the
data and control paths, the rounds run for the cross-rank check alone, the
times the host waited for the device (counted on the CPU at the same places,
since it runs the same code), device operations, and allocations. The
process's totals add the arrays this Python layer allocated (outputs made
without ``out=``, workspaces). A GPU step's host overhead is then visible, and
testable, on a CPU::

    with a2a.counting(comm) as cost:
        a2a.all_to_all(x, comm=comm, algo="2dh")
    assert cost.counters.check_rounds == 0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Self

from . import _C

__all__ = ["Counters", "counters", "counting"]

_python_allocations = 0  # arrays allocated by a2a's Python layer (process-wide)


def note_allocation(n: int = 1) -> None:
    """Counts arrays that a2a's Python layer allocated for the caller."""
    global _python_allocations
    _python_allocations += n


@dataclass(frozen=True)
class Counters:
    """Counts since creation (of the communicator, or of the process); subtract two for an interval."""

    calls: int = 0  # entries into the native library (per communicator: calls on it)
    collectives: int = 0  # collectives and checked calls started
    data_rounds: int = 0  # exchanges and collectives on the data path
    data_messages: int = 0  # point-to-point messages this rank posted to other ranks (data path)
    control_rounds: int = 0  # the same on the control path (counts, the check by round)
    control_messages: int = 0
    check_rounds: int = 0  # rounds run for the cross-rank check alone (also control rounds)
    host_waits: int = 0  # the host waited for the device (or would, on a GPU)
    kernel_calls: int = 0  # device operations enqueued: copies, transposes, MoE kernels
    allocations: int = 0  # buffers allocated by the library

    def __sub__(self, other: Counters) -> Counters:
        """The counts of the interval from `other` (taken earlier) to this."""
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: Counters) -> Counters:
        """The counts of two intervals together."""
        return Counters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        """The counts by name."""
        return asdict(self)

    def per(self, calls: int) -> dict[str, float]:
        """Each count divided by `calls` (the cost of one of several equal calls)."""
        return {name: value / calls for name, value in asdict(self).items()}


def _require_comm(comm: Any, op: str) -> None:
    """A communicator (its counters) or None (the process's totals): anything else is a TypeError."""
    if comm is not None and not hasattr(comm, "_native"):
        raise TypeError(f"{op}: comm must be an a2a.Comm or None (the process's totals), got {type(comm).__name__}")


def counters(comm: Any = None) -> Counters:
    """The counters of `comm` (an :class:`a2a.Comm`), or with None the process's totals."""
    _require_comm(comm, "counters")
    if comm is None:
        counts = Counters(**_C.process_counters())
        return Counters(**{**counts.as_dict(), "allocations": counts.allocations + _python_allocations})
    return Counters(**comm._native.counters())


class counting:
    """A context manager whose ``counters`` is what the block cost on `comm`
    (None: the process); read inside the block, what it cost so far."""

    def __init__(self, comm: Any = None):
        _require_comm(comm, "counting")
        self.comm = comm
        self._start: Counters | None = None
        self._end: Counters | None = None

    def __enter__(self) -> Self:
        self._start, self._end = counters(self.comm), None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = counters(self.comm)

    @property
    def counters(self) -> Counters:
        """What the block cost (inside it: so far)."""
        if self._start is None:
            raise RuntimeError("a2a.counting: read .counters inside or after a `with` block")
        return (self._end or counters(self.comm)) - self._start
