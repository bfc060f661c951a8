"""Reused buffers: the big per-step tensors of a layer are allocated once.

On a CPU a fresh (E, C, M) buffer costs more than the kernel that fills it
(page faults on memory the allocator just took from the kernel: encode at
T=16384, M=4096 spends 223 ms allocating against 23 ms into a reused
buffer). A :class:`BufferPool` keeps sets of named flat buffers; a call
takes a :class:`Lease` on one set, views its buffers with the shapes of the
call (a buffer grows when a shape outgrows it), and gives the set back when
the lease dies, which for a training step is when autograd frees the step's
graph. A step whose predecessor's graph is still alive (the caller still
holds its loss) gets a second set, so a training loop settles on two sets.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["BufferPool", "Lease"]


class BufferPool:
    """Free sets of named buffers; :meth:`lease` hands one out."""

    def __init__(self) -> None:
        self._free: list[dict[str, torch.Tensor]] = []
        self.sets_created = 0  # how many sets were ever made (tests, benchmarks)
        self._isolating = False
        # The sets that captures by the layer's caller took (for_capture): kept, as the graphs write them.
        self.captured: list[list[dict[str, torch.Tensor]]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> BufferPool:
        """An empty pool: buffers belong to the calls that leased them (common/copying.py)."""
        return BufferPool()

    def lease(self) -> Lease:
        if self._free:
            return Lease(self._free, self._free.pop())
        self.sets_created += 1
        return Lease(self._free, {})

    @contextlib.contextmanager
    def isolated(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Leases taken inside come from, and go back to, a list of their own
        (yielded: whoever keeps it keeps their buffers), never the pool's:
        the buffers of a captured CUDA graph, which its replays write, are
        then never a later eager call's (common/graphs.py)."""
        kept, self._free, self._isolating = self._free, [], True
        try:
            yield self._free
        finally:
            self._free, self._isolating = kept, False

    @contextlib.contextmanager
    def for_capture(self) -> Iterator[None]:
        """Leases taken inside, in a CUDA graph that the layer's caller
        captures, come from sets kept in :attr:`captured` until
        :meth:`drop_captured`: the graph's replays write those buffers, so no
        eager call may take or grow them. Inside :meth:`isolated` (the layer's
        own captures, which keep their sets) it changes nothing."""
        if self._isolating:
            yield
            return
        with self.isolated() as sets:
            self.captured.append(sets)
            yield

    def drop_captured(self) -> None:
        """Forgets the sets of the caller's captures (once their graphs are gone)."""
        self.captured.clear()

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(name, address, bytes) of every buffer of the free sets, sorted: two
        equal snapshots mean nothing was allocated or grown in between (tests,
        benchmarks)."""
        return sorted((name, t.data_ptr(), t.numel() * t.element_size())
                      for buffers in self._free for name, t in buffers.items())

    def clear(self) -> None:
        """Drops the free sets (leases still held keep theirs)."""
        self._free.clear()


class Lease:
    """One set of buffers for one call; returned to the free list it came from when deleted."""

    def __init__(self, home: list[dict[str, torch.Tensor]], buffers: dict[str, torch.Tensor]):
        self._home, self._buffers = home, buffers

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of `shape` over buffer `name` (contents undefined)."""
        count = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < count or buffer.dtype != dtype or buffer.device != device:
            # Never an inference tensor, which a call under torch.inference_mode() would make: the training
            # calls after it could not write it ("Inplace update to inference tensor outside InferenceMode").
            with torch.inference_mode(False):
                buffer = torch.empty(count, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return (buffer if buffer.numel() == count else buffer[:count]).view(shape)  # (a slice is one op more)

    def __del__(self) -> None:
        home, self._home = self._home, None
        if home is not None:
            home.append(self._buffers)
