"""What an unpickled a2a.Routing must hold before a kernel may trust it.

``route`` and ``permute`` make a routing's tables themselves, and the
kernels read them unchecked: choice (t, j) of expert e = indices[t, j] is
kept when 0 <= e and 0 <= locations[t, j] < counts[e], and then occupies row
offsets[e] + locations[t, j]; rows offsets[e] + counts[e] .. offsets[e + 1]
- 1 are an expert's padding. A routing that comes back from pickle (a deep
copy, a file, another process) brings tables that no route made, so they are
checked here, on the host, before any kernel can read them: a table that
would send a kernel out of bounds, or two choices into one row, raises
InvalidArgumentError naming the first entry at fault::

    indices (T, k) int32 / int64; locations (T, k), counts (E,), offsets (E + 1,) int64,
        all C-contiguous, beside the indices
    offsets[0] = 0, never decreasing, and the capacity's layout:
        one capacity C          offsets[e] = e C,             num_rows = E C
        per-expert capacities   offsets = their prefix sums,  num_rows = their sum
        dropless                num_rows = offsets[E] (T k where the permute did not wait)
    0 <= counts[e] <= offsets[e + 1] - offsets[e]
    an index >= E is not routed: its location is negative
    the kept choices' rows all differ
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import ArrayView, view
from ._errors import InvalidArgumentError

__all__ = ["check_unpickled"]


def _fail(message: str):
    raise InvalidArgumentError(f"a2a.Routing (unpickled): {message}")


def _host(v: ArrayView) -> np.ndarray:
    """The values of the array of `v`, in host memory (a copy from a device)."""
    if v.framework == "torch":
        return v.obj.detach().cpu().numpy()
    if v.framework == "cupy":
        return v.obj.get()
    return np.asarray(v.obj)


def _table(table: Any, name: str, shape: tuple[int, ...], indices: ArrayView) -> np.ndarray:
    """`table` checked (int64, `shape`, C-contiguous, beside the indices), as a host array."""
    v = view(table, name)
    if v.dtype_name != "int64" or tuple(v.shape) != shape or not v.contiguous or not v.same_place(indices):
        _fail(f"{name} must be a C-contiguous {shape} int64 array beside the indices ({indices.describe()}); "
              f"got {v.describe()}")
    return _host(v)


def _layout(offsets: np.ndarray, capacity: Any, num_rows: int, num_experts: int, bound: int | None) -> None:
    """The offsets and num_rows of the capacity's layout (module docstring)."""
    if isinstance(capacity, tuple):
        capacities = np.asarray(capacity, dtype=np.int64)
        if len(capacities) != num_experts or (capacities < 0).any():
            _fail(f"per-expert capacities {list(capacity)} must be {num_experts} integers >= 0")
        expected = np.concatenate(([0], np.cumsum(capacities)))
        name = "the prefix sums of the per-expert capacities"
    elif capacity is None:  # the offsets are the counts' own: only their order and end are the layout's
        if (np.diff(offsets) < 0).any() or offsets[0] != 0:
            _fail(f"the dropless offsets {offsets.tolist()} must start at 0 and never decrease")
        if num_rows != (offsets[-1] if bound is None else bound):
            _fail(f"num_rows is {num_rows}; the dropless layout has "
                  f"{offsets[-1] if bound is None else f'T * k = {bound}'}")
        return
    else:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            _fail(f"capacity must be an integer >= 0, got {capacity!r}")
        expected = np.arange(num_experts + 1, dtype=np.int64) * capacity
        name = f"e * capacity (capacity {capacity})"
    wrong = np.flatnonzero(offsets != expected)
    if wrong.size:
        e = int(wrong[0])
        _fail(f"offsets[{e}] = {int(offsets[e])}; the layout has {int(expected[e])} ({name})")
    if num_rows != expected[-1]:
        _fail(f"num_rows is {num_rows}; the layout has {int(expected[-1])}")


def check_unpickled(indices: ArrayView, locations: Any, counts: Any, offsets: Any, capacity: Any, num_rows: Any,
                    bounded: bool, host_counts: Any = None) -> None:
    """Raises InvalidArgumentError unless the tables are a routing's (module docstring); `host_counts`,
    where the routing has them, must be its counts."""
    if len(indices.shape) != 2 or indices.dtype_name not in ("int32", "int64") or not indices.contiguous:
        _fail(f"indices must be a C-contiguous (T, k) int32 or int64 array; got {indices.describe()}")
    num_tokens, top_k = indices.shape
    counted = view(counts, "counts")
    if len(counted.shape) != 1 or counted.shape[0] < 1:
        _fail(f"counts must be (E,) with E >= 1; got {counted.describe()}")
    num_experts = counted.shape[0]
    locations = _table(locations, "locations", (num_tokens, top_k), indices)
    counts = _table(counts, "counts", (num_experts,), indices)
    offsets = _table(offsets, "offsets", (num_experts + 1,), indices)
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
        _fail(f"num_rows must be an integer >= 0, got {num_rows!r}")
    _layout(offsets, capacity, num_rows, num_experts, num_tokens * top_k if bounded else None)
    room = np.diff(offsets)
    wrong = np.flatnonzero((counts < 0) | (counts > room))
    if wrong.size:
        e = int(wrong[0])
        _fail(f"counts[{e}] = {int(counts[e])}; expert {e} has {int(room[e])} rows")
    if host_counts is not None and not np.array_equal(np.asarray(host_counts), counts):
        _fail(f"host_counts {np.asarray(host_counts).tolist()} are not the counts {counts.tolist()}")
    experts = _host(indices).astype(np.int64)
    beyond = np.argwhere((experts >= num_experts) & (locations >= 0))
    if beyond.size:
        t, j = (int(i) for i in beyond[0])
        _fail(f"indices[{t}, {j}] = {int(experts[t, j])} is no expert of {num_experts}, yet locations[{t}, {j}] = "
              f"{int(locations[t, j])} places it")
    routed = (experts >= 0) & (experts < num_experts)
    safe = np.where(routed, experts, 0)
    kept = routed & (locations >= 0) & (locations < counts[safe])
    rows = np.where(kept, offsets[safe] + locations, -1)
    values, times = np.unique(rows[kept], return_counts=True)
    if (times > 1).any():
        row = int(values[times > 1][0])
        first, second = np.argwhere(rows == row)[:2].tolist()
        _fail(f"choices {tuple(first)} and {tuple(second)} both occupy row {row}")
