"""MoE routing: where every (token, choice) of a gate's top-k goes.

``route`` hands out slots in Tutel's order under a capacity, one for all
experts or one per expert (the capacity rules are in its docstring and
docs/moe_kernels.md); ``permutation`` is the
dropless routing of ``permute``. A :class:`Routing` keeps the tables that the
kernels read to itself: what it hands out are copies, so nothing done to them
can send a kernel out of bounds.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from . import _C
from ._arrays import FLOAT_DTYPES, ArrayView, address_of, argument_view, copy_of, empty_like, shown_copy, view
from ._comm import Comm
from ._errors import InvalidArgumentError
from ._routing_state import check_unpickled

__all__ = ["Routing", "native_routing", "permutation", "require_dropless", "require_padded", "require_routing", "route",
           "routing_view"]

INDEX_DTYPES = ("int32", "int64")
DROPLESS = -1  # A2A_CAPACITY_DROPLESS
PER_EXPERT = -2  # A2A_CAPACITY_PER_EXPERT
INT64_MAX = 2**63 - 1  # the core takes counts and capacities as int64_t
# The routing's offsets, num_experts + 1 int64 values, must fit in an array.
MAX_EXPERTS = INT64_MAX // 8 - 1
_EXPERTS_BOUND = "num_experts + 1 int64 offsets must fit in 2**63 - 1 bytes"


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


class Routing:
    """Where every (token, choice) goes: see docs/moe_kernels.md.

    Made by :func:`a2a.route` (the padded (E, C, M) layout of a capacity, or
    the ragged (sum of C_e, M) layout of per-expert capacities C_e) and
    :func:`a2a.permute` (the dropless layout); it cannot be built or
    changed by hand. Its arrays have the framework and device of the indices
    it was made from: ``indices`` (T, k), ``locations`` (T, k) int64,
    ``counts`` (E,) int64 choices kept per expert, ``offsets`` (E + 1,) int64
    first row of each expert, ``row_map`` (T, k) int64 row of each choice (-1
    when not kept). Every access gives a new copy of the tables the kernels
    read (read-only for NumPy), so the routing cannot be changed through them.
    """

    __slots__ = ("_bounded", "_capacity", "_counts", "_host_counts", "_indices", "_locations", "_native",
                 "_num_dropped", "_num_rows", "_offsets", "_unread")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("an a2a.Routing is made by a2a.route or a2a.permute, not directly")

    @classmethod
    def _create(cls, indices: ArrayView, locations: Any, counts: Any, offsets: Any,
                capacity: int | tuple[int, ...] | None, num_rows: int, num_dropped: int | None,
                unread: _Tables | None = None, host_counts: np.ndarray | None = None,
                bounded: bool = False) -> Routing:
        self = object.__new__(cls)
        # permute(wait=False): dropless with num_rows = T*k, a bound; the rows past the routed choices are the
        # last expert's padding, which the kernels zero (they take it as per-expert capacities).
        self._bounded = bounded
        self._host_counts = host_counts  # counts on the host, where the route waited for them
        self._indices = indices  # a view of the private copy of the caller's indices
        self._locations, self._counts, self._offsets = locations, counts, offsets
        self._capacity, self._num_rows, self._num_dropped = capacity, num_rows, num_dropped
        self._unread = unread  # route(wait=False): the tables whose workspace holds num_dropped and any fault
        self._native = None  # native_routing's tuple, made at the first kernel call
        return self

    def __getstate__(self) -> dict[str, Any]:
        """The arrays and sizes, not the view of the indices (an address): a
        copy or an unpickled routing views its own indices."""
        tables = (self._locations, self._counts, self._offsets)
        sizes = (self._capacity, self._num_rows, self.num_dropped)  # (read now for a routing of route(wait=False))
        return {"indices": self._indices.obj, "tables": tables, "sizes": sizes, "host_counts": self._host_counts,
                "bounded": self._bounded}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The tables are checked before any kernel can read them (a2a/_routing_state.py): no route made them."""
        self._indices = view(state["indices"], "indices")
        self._locations, self._counts, self._offsets = state["tables"]
        self._capacity, self._num_rows, self._num_dropped = state["sizes"]
        self._host_counts = state.get("host_counts")
        self._bounded = state.get("bounded", False)
        self._unread = None
        self._native = None
        check_unpickled(self._indices, self._locations, self._counts, self._offsets, self._capacity, self._num_rows,
                        self._bounded, self._host_counts)

    _show = staticmethod(shown_copy)

    @property
    def indices(self) -> Any:
        """(T, k) the expert of each choice (a copy of the input); negative: not routed."""
        return self._show(self._indices.obj)

    @property
    def locations(self) -> Any:
        """(T, k) int64: slot of each choice inside its expert; -1 if not routed, >= counts[e] if dropped."""
        return self._show(self._locations)

    @property
    def counts(self) -> Any:
        """(E,) int64: choices kept per expert."""
        return self._show(self._counts)

    @property
    def host_counts(self) -> np.ndarray | None:
        """``counts`` as a read-only (E,) int64 NumPy array, known on the host
        since the route waited for the device (route with one capacity or a
        capacity rule, and permute): reading it waits for nothing, where
        ``counts`` of a CUDA routing is a device tensor whose read waits for
        the stream. None where the route waited for nothing (``wait=False``)
        or took per-expert capacities."""
        return None if self._host_counts is None else self._show(self._host_counts)

    @property
    def offsets(self) -> Any:
        """(E + 1,) int64: first row of each expert (e * C; the prefix sums of the per-expert
        capacities; or of counts when dropless)."""
        return self._show(self._offsets)

    @property
    def row_map(self) -> Any:
        """(T, k) int64: the row each choice occupies in the dispatched buffer, -1 when not kept (a new array)."""
        e, locations, counts, offsets = self._indices.obj, self._locations, self._counts, self._offsets
        last = len(counts) - 1  # an index >= E (not routed by a route or permute that did not wait) is not kept
        if self._indices.framework == "torch":
            import torch

            e = e.long()
            safe = e.clamp(0, last)
            kept = (e >= 0) & (e <= last) & (locations < counts[safe])
            return torch.where(kept, offsets[safe] + locations, torch.full_like(locations, -1))
        xp = _array_module(self._indices)
        with self._indices.device_guard():
            e = e.astype(xp.int64)
            safe = xp.clip(e, 0, last)
            kept = (e >= 0) & (e <= last) & (locations < counts[safe])
            return xp.where(kept, offsets[safe] + locations, -1)

    @property
    def num_tokens(self) -> int:
        """T, the tokens routed."""
        num_tokens, _ = self._indices.shape
        return num_tokens

    @property
    def top_k(self) -> int:
        """k, the choices per token."""
        _, top_k = self._indices.shape
        return top_k

    @property
    def num_experts(self) -> int:
        """E, the experts."""
        return len(self._counts)

    @property
    def capacity(self) -> int | np.ndarray | None:
        """C, the rows per expert; with per-expert capacities (``route(...,
        capacity=<(E,) array>)``) a new read-only (E,) int64 NumPy array of
        them (as agreed across ranks); None for the dropless layout of permute."""
        if isinstance(self._capacity, tuple):
            return self._show(np.array(self._capacity, dtype=np.int64))
        return self._capacity

    @property
    def per_expert(self) -> bool:
        """Whether every expert has its own capacity (the ragged layout: expert
        e owns rows offsets[e] .. offsets[e + 1] - 1 of a (num_rows, M) buffer)."""
        return isinstance(self._capacity, tuple)

    @property
    def dropless(self) -> bool:
        """Whether this is the dropless layout of permute (no capacity)."""
        return self._capacity is None

    @property
    def num_rows(self) -> int:
        """Rows of the dispatched buffer: E * C, the sum of the per-expert capacities, or the routed
        choices when dropless (T * k for ``permute(..., wait=False)``: a bound, known without the device)."""
        return self._num_rows

    @property
    def num_dropped(self) -> int:
        """Routed choices that did not fit their expert's capacity. For a
        routing of ``route(..., wait=False)`` or ``permute(..., wait=False)`` every read waits for the current
        stream (where the count is: a routing captured in a CUDA graph gives
        its last replay's) and raises InvalidArgumentError for an index >=
        num_experts, as ``route`` would have."""
        tables = self._unread
        if tables is None:
            return self._num_dropped
        num_tokens, top_k = self._indices.shape
        with self._indices.device_guard():  # read on the current stream (a graph replays on the caller's)
            return _C.route_fixed_dropped(self._indices.execution(), num_tokens, top_k, len(self._counts),
                                          address_of(tables.workspace), tables.workspace.nbytes)

    def __repr__(self) -> str:
        capacity = list(self._capacity) if isinstance(self._capacity, tuple) else self._capacity
        layout = "dropless" if capacity is None else f"capacity={capacity}"
        sizes = f"num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, {layout}"
        dropped = "on the device" if self._unread is not None else self._num_dropped  # repr waits for nothing
        rows = f"num_rows={self._num_rows}, num_dropped={dropped}"
        return f"a2a.Routing({sizes}, {rows}, on {self._indices.framework} {self._indices.device_text})"


def routing_view(routing: Routing) -> ArrayView:
    """The view of the routing's own indices: the framework and device the
    data of its kernels must share."""
    return routing._indices


def native_routing(routing: Routing) -> tuple:
    """The routing as a2a._C's kernels take it (a2a_routing_t's fields),
    made once: a routing's tables never change."""
    if routing._native is None:
        routing._native = _native_fields(routing)
    return routing._native


def _native_fields(routing: Routing) -> tuple:
    return (
        routing.num_tokens,
        routing.top_k,
        routing.num_experts,
        routing._indices.address,
        routing._indices.dtype_code,
        address_of(routing._locations),
        address_of(routing._counts),
        address_of(routing._offsets),
        PER_EXPERT if routing.per_expert or routing._bounded else DROPLESS if routing._capacity is None
        else routing._capacity,
        routing._num_rows,
    )


def require_padded(routing: Any, op: str) -> Routing:
    """`routing` if it is a Routing with a capacity (from route)."""
    require_routing(routing, "routing", op)
    if routing.capacity is None:
        _fail(op, "this routing is dropless (from a2a.permute); use a2a.permute / a2a.unpermute with it")
    return routing


def require_dropless(routing: Any, op: str, what: str = "perm") -> Routing:
    """`routing` (the argument `what`) if it is a dropless Routing (from permute)."""
    require_routing(routing, what, op)
    if routing.capacity is not None:
        _fail(op, "this routing has a capacity (from a2a.route); use a2a.fast_encode / a2a.fast_decode with it")
    return routing


def require_routing(routing: Any, what: str, op: str) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"{op}: {what} must be an a2a.Routing (from a2a.route or a2a.permute), got {type(routing).__name__}")


def _array_module(v: ArrayView) -> Any:
    """NumPy or CuPy, whichever `v` belongs to (not torch)."""
    if v.framework == "cupy":
        import cupy

        return cupy
    return np


def _as_int(value: Any, what: str, op: str, minimum: int, maximum: int = INT64_MAX,
            bound: str = "2**63 - 1: the core takes an int64") -> int:
    if isinstance(value, bool):
        _fail(op, f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        _fail(op, f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if number < minimum:
        _fail(op, f"{what} must be >= {minimum}, got {number}")
    if number > maximum:
        _fail(op, f"{what} {number} is too large; the limit is {maximum} ({bound})")
    return number


def _as_float(value: Any, what: str, op: str) -> float:
    try:
        number = float(value)
    except OverflowError:
        _fail(op, f"{what} is too large for a float64 (the limit is {np.finfo(np.float64).max:g})")
    except (TypeError, ValueError):
        _fail(op, f"{what} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):
        _fail(op, f"{what} must be finite, got {number}")
    return number


def _private_indices(indices: Any, op: str) -> ArrayView:
    """A view of a private copy of `indices` (the kernels trust the routing,
    so no later change to the caller's array may reach them)."""
    v = argument_view(indices, "indices", op)
    if len(v.shape) != 2 or v.dtype_name not in INDEX_DTYPES:
        _fail(op, f"indices must be a 2-D (tokens, top_k) array of int32 or int64; got {v.describe()}")
    if v.shape[1] == 0:
        _fail(op, f"indices has top_k == 0 ({v.describe()}); every token needs at least one choice")
    copy = copy_of(v.obj)
    if v.framework == "torch":  # the copy's view from the checked one's (a view costs microseconds per route)
        return ArrayView(copy, "torch", v.shape, v.dtype_name, v.itemsize, copy.data_ptr(), True, True, v.cuda_device)
    return view(copy, "indices")


def _token_order(scores: Any, idx: ArrayView, op: str) -> Any:
    """Batch Prioritized Routing: tokens by descending score (their row
    maximum), ties in token order; NaN scores last, in every framework
    (sorting -score ascending: NaN last in torch's sort as in NumPy's, where
    a descending sort of torch puts them first)."""
    if scores is None:
        _fail(op, "batch_prioritized=True needs scores (tokens,) or (tokens, n)")
    s = argument_view(scores, "scores", op)
    if not s.same_place(idx):
        _fail(op, f"scores ({s.describe()}) are not where the indices are ({idx.describe()})")
    num_tokens = idx.shape[0]
    if len(s.shape) not in (1, 2) or s.shape[0] != num_tokens or (len(s.shape) == 2 and s.shape[1] == 0):
        _fail(op, f"scores must be (tokens,) or (tokens, n) with tokens = {num_tokens}; got {s.describe()}")
    if s.dtype_name not in FLOAT_DTYPES:
        _fail(op, f"scores must be {', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}; got {s.describe()}")
    if s.framework == "torch":
        import torch

        priority = s.obj if len(s.shape) == 1 else s.obj.amax(dim=1)
        return torch.argsort(-priority, stable=True).contiguous()  # indices: no gradient, nothing to detach
    xp = _array_module(s)
    with s.device_guard():
        priority = s.obj if len(s.shape) == 1 else s.obj.max(axis=1)
        return xp.ascontiguousarray(xp.argsort(-priority.astype(xp.float64), kind="stable").astype(xp.int64))


class _Tables:
    """The arrays route fills, allocated beside the indices: locations (T, k),
    counts (E,), offsets (E + 1,) and the scan's workspace."""

    def __init__(self, idx: ArrayView, num_experts: int):
        num_tokens, top_k = idx.shape
        self.execution = idx.execution()
        self.locations = empty_like(idx, (num_tokens, top_k), "int64")
        self.counts = empty_like(idx, (num_experts,), "int64")
        self.offsets = empty_like(idx, (num_experts + 1,), "int64")
        workspace_bytes = _C.route_workspace_size(self.execution, num_tokens, top_k, num_experts)
        self.workspace = empty_like(idx, (workspace_bytes,), "uint8")


def _locate_fixed(idx: ArrayView, tables: _Tables, num_experts: int, capacity: int, order: Any) -> Routing:
    """Runs the core's route_fixed into `tables`: nothing is read back. DROPLESS: permute's layout with
    T*k rows (a bound)."""
    num_tokens, top_k = idx.shape
    with idx.device_guard():
        _C.route_fixed(tables.execution, idx.address, idx.dtype_code, num_tokens, top_k, num_experts,
                       0 if order is None else address_of(order), capacity, address_of(tables.workspace),
                       tables.workspace.nbytes, address_of(tables.locations), address_of(tables.counts),
                       address_of(tables.offsets))
    if capacity == DROPLESS:
        return Routing._create(idx, tables.locations, tables.counts, tables.offsets, None, num_tokens * top_k, None,
                               tables, bounded=True)
    return Routing._create(idx, tables.locations, tables.counts, tables.offsets, capacity, num_experts * capacity,
                           None, tables)


def _locate(idx: ArrayView, tables: _Tables, num_experts: int, capacity: int | list[int], setting: float,
            order: Any, comm: Comm | None) -> Routing:
    """Runs the core's route (collective with a comm) into `tables`: one
    capacity (an int), or one per expert (a list)."""
    num_tokens, top_k = idx.shape
    problem = (tables.execution, None if comm is None else comm._native, idx.address, idx.dtype_code, num_tokens,
               top_k, num_experts, 0 if order is None else address_of(order))
    outputs = (address_of(tables.workspace), tables.workspace.nbytes, address_of(tables.locations),
               address_of(tables.counts), address_of(tables.offsets))
    with idx.device_guard():
        host_counts = None
        if isinstance(capacity, list):
            num_rows, num_dropped, agreed = _C.route_capacities(*problem, capacity, *outputs)
            kept: int | tuple[int, ...] | None = tuple(agreed)
        else:
            host_counts = np.empty(num_experts, dtype=np.int64)  # the counts the route knows on the host
            final_capacity, num_rows, num_dropped = _C.route(*problem, capacity, setting, *outputs,
                                                             host_counts.ctypes.data)
            kept = None if final_capacity < 0 else final_capacity
    return Routing._create(idx, tables.locations, tables.counts, tables.offsets, kept, num_rows, num_dropped,
                           host_counts=host_counts)


def _is_per_expert(capacity: Any) -> bool:
    """Whether `capacity` is an array-like of per-expert capacities (not one number)."""
    shape = getattr(capacity, "shape", None)
    if shape is not None:
        return len(shape) >= 1
    return isinstance(capacity, (list, tuple, range))


def _per_expert_capacities(capacity: Any, num_experts: int, op: str) -> list[int]:
    """The (E,) capacities as a list of ints >= 0 with an int64 sum."""
    shape = getattr(capacity, "shape", None)
    if shape is not None and len(shape) != 1:
        _fail(op, f"capacity must be one number or a 1-D array of one per expert; got shape {tuple(shape)}")
    values = capacity.tolist() if hasattr(capacity, "tolist") else list(capacity)
    if len(values) != num_experts:
        _fail(op, f"capacity has {len(values)} entries; expected one per expert (num_experts = {num_experts})")
    capacities = [_as_int(value, f"capacity[{e}]", op, 0) for e, value in enumerate(values)]
    if sum(capacities) > INT64_MAX:
        _fail(op, f"the capacities sum to {sum(capacities)}, more than 2**63 - 1 rows")
    return capacities


def route(
    indices: Any,
    num_experts: int,
    *,
    capacity: Any = None,
    capacity_setting: float | None = None,
    scores: Any = None,
    batch_prioritized: bool = False,
    comm: Comm | None = None,
    wait: bool = True,
) -> Routing:
    """Slots for a gate's top-k choices (Tutel's routing).

    ``indices`` (T, k) int32/int64, C-contiguous: the expert of every choice;
    negative means not routed. ``capacity`` fixes the rows per expert;
    otherwise ``capacity_setting`` x (default 1.0): x > 0 gives ceil(k*x*T/E),
    x == 0 the smallest capacity that drops nothing, x < 0 like 0 but at most
    ceil(k*(-x)*T/E). ``capacity`` may also be an array-like of E integers
    >= 0 (a list, NumPy array or tensor): one capacity per expert (DynaMoE),
    the ragged layout where expert e owns ``capacity[e]`` rows from
    ``offsets[e]`` (``routing.capacity`` is then that array). All first
    choices take slots before any second choice;
    ``batch_prioritized=True`` orders tokens by descending ``scores`` ((T,)
    or (T, n), C-contiguous, beside the indices). With ``comm`` the call is
    collective, the capacity (each expert's, when per expert) is the maximum
    over the ranks, and a local error
    is raised on every rank (RemoteError on the others). Choices beyond the
    capacity are dropped (``num_dropped``). ``num_experts`` and ``capacity``
    (or the sum of the per-expert ones) are at most 2**63 - 1.

    ``wait=False`` (one ``capacity``, no ``comm``): nothing comes back to the
    host, so on a GPU the call only enqueues kernels (a CUDA graph may capture
    it); the layout follows from the capacity alone. ``num_dropped`` and an
    index >= num_experts (not routed meanwhile: the kernels stay in bounds)
    are read, and raised, when ``routing.num_dropped`` is first read.
    """
    op = "route"
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"{op}: comm must be an a2a.Comm, got {type(comm).__name__}")
    try:
        idx = _private_indices(indices, op)
        num_experts = _as_int(num_experts, "num_experts", op, 1, MAX_EXPERTS, _EXPERTS_BOUND)
        _check_wait(wait, op)
        if capacity is not None and capacity_setting is not None:
            _fail(op, "pass either capacity or capacity_setting, not both")
        if _is_per_expert(capacity):
            capacity = _per_expert_capacities(capacity, num_experts, op)
        elif capacity is not None:
            capacity = _as_int(capacity, "capacity", op, 1)
        setting = 1.0 if capacity_setting is None else _as_float(capacity_setting, "capacity_setting", op)
        if not wait and (comm is not None or not isinstance(capacity, int)):
            _fail(op, "wait=False takes one capacity (an integer) and no comm: the layout must follow from the "
                      "capacity alone; got " + ("a comm" if comm is not None else
                                               "capacity_setting" if capacity is None else "per-expert capacities"))
        order = _token_order(scores, idx, op) if batch_prioritized else None
        tables = _Tables(idx, num_experts)
    except Exception as error:
        if comm is None:
            raise
        # Every rank must learn of it (they raise RemoteError) instead of waiting.
        message = str(error).removeprefix(f"{op}: ")
        if not isinstance(error, InvalidArgumentError):
            message = f"{type(error).__name__}: {message}"
        comm._native.report_invalid(op, f"{op} on rank {comm.rank} of {comm.size}: {message}")
        raise  # not reached: report_invalid raises
    if not wait:
        return _locate_fixed(idx, tables, num_experts, capacity, order)
    return _locate(idx, tables, num_experts, 0 if capacity is None else capacity, setting, order, comm)


def _check_wait(wait: Any, op: str) -> None:
    """route's and permute's `wait`: True or False, nothing else (a truthy string would pass as True)."""
    if not isinstance(wait, bool):
        raise TypeError(f"{op}: wait must be True or False, got {wait!r}")


def permutation(indices: Any, num_experts: Any, op: str, wait: bool = True) -> Routing:
    """The dropless routing of permute (every routed choice kept, rows packed by expert); `wait` False:
    T*k rows, nothing read back (see a2a.permute)."""
    idx = _private_indices(indices, op)
    num_experts = _as_int(num_experts, "num_experts", op, 1, MAX_EXPERTS, _EXPERTS_BOUND)
    _check_wait(wait, op)
    tables = _Tables(idx, num_experts)
    if not wait:
        return _locate_fixed(idx, tables, num_experts, DROPLESS, None)
    return _locate(idx, tables, num_experts, DROPLESS, 0.0, None, None)
