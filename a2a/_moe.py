"""MoE routing and Tutel's fast encode / decode, plus the dropless permute.

``route`` turns a gate's top-k expert indices into slots, ``fast_encode``
scatters tokens into the (E, C, M) buffer that the all-to-all moves and
``fast_decode`` gathers them back with the gates; ``permute`` / ``unpermute``
do the same without a capacity (rows packed by expert, for
``all_to_all_v``). docs/moe_kernels.md shows the layouts.

Inputs are NumPy arrays, torch tensors (CPU, or CUDA when the CUDA backend
is built; then the kernels run on the current torch stream) or CuPy arrays
(on the current CuPy stream); outputs have the framework and device of the
inputs, or go to ``out=`` (C-contiguous, the
result's dtype, element count and device; returned with the result's shape).
With torch tensors that require grad the ops record autograd through a2a.torch
(and take no ``out=``).
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any

import numpy as np

from . import _C
from ._arrays import DTYPE_CODES, address_of, is_cupy_array, is_torch_tensor, view
from ._comm import Comm
from ._errors import InvalidArgumentError

__all__ = ["Routing", "fast_decode", "fast_encode", "permute", "route", "unpermute"]

_FLOATS = ("float32", "float64", "float16", "bfloat16")
_INDICES = ("int32", "int64")
_DEVICE_CPU, _DEVICE_CUDA = 0, 1
_DROPLESS = -1  # A2A_CAPACITY_DROPLESS


def _torch():
    import torch

    return torch


def _cupy():
    import cupy

    return cupy


class _Array:
    """One argument as the core sees it: a C-contiguous array (copied to one
    if it was not), its dtype name and address, and where it lives
    (`device`: a torch.device, "cuda:N" for CuPy, None for NumPy)."""

    __slots__ = ("address", "array", "device", "dtype", "framework", "shape")

    def __init__(self, x: Any, what: str, op: str):
        if is_torch_tensor(x):
            if x.device.type not in ("cpu", "cuda"):
                raise InvalidArgumentError(f"{op}: {what} is a torch tensor on {x.device}; a2a runs on cpu and cuda")
            x = x.contiguous()
            self.framework, self.device = "torch", x.device
            self.dtype = str(x.dtype).removeprefix("torch.")
            self.address = x.data_ptr()
        elif is_cupy_array(x):
            # CuPy makes new arrays on the current device: make it x's.
            with x.device:
                x = _cupy().ascontiguousarray(x)
            self.framework, self.device = "cupy", f"cuda:{x.device.id}"
            self.dtype = x.dtype.name
            self.address = x.data.ptr
        else:
            try:
                v = view(x, what)  # NumPy, DLPack and buffer objects; rejects other memory
            except InvalidArgumentError as error:
                raise InvalidArgumentError(f"{op}: {error}") from None
            x = v.obj if v.contiguous else np.ascontiguousarray(v.obj)
            self.framework, self.device = "numpy", None
            self.dtype = v.dtype_name
            self.address = x.ctypes.data
        self.array = x
        self.shape = tuple(x.shape)

    @property
    def on_cuda(self) -> bool:
        return self.framework == "cupy" or (self.framework == "torch" and self.device.type == "cuda")

    @property
    def cuda_index(self) -> int:
        return int(self.device.split(":")[1]) if self.framework == "cupy" else self.device.index

    def place(self) -> str:
        return "numpy" if self.framework == "numpy" else f"{self.framework} {self.device}"

    def describe(self) -> str:
        return f"{self.place()} array of shape {self.shape} and dtype {self.dtype}"


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


def _same_place(op: str, first: _Array, *others: _Array | None) -> None:
    for other in others:
        if other is not None and (other.framework, other.device) != (first.framework, first.device):
            _fail(op, f"arrays live in different places: {first.describe()} and {other.describe()}")


def _empty(like: _Array, shape: tuple[int, ...], dtype: str) -> Any:
    if like.framework == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if like.framework == "cupy":
        with _device_guard(like):
            return _cupy().empty(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


def _exec(like: _Array) -> tuple[int, int, int]:
    """(device type, stream, threads) for the core: the framework's current stream on CUDA."""
    if like.framework == "cupy":
        with _device_guard(like):
            return (_DEVICE_CUDA, _cupy().cuda.get_current_stream().ptr, 0)
    if like.on_cuda:
        return (_DEVICE_CUDA, _torch().cuda.current_stream(like.device).cuda_stream, 0)
    return (_DEVICE_CPU, 0, 0)


def _device_guard(like: _Array):
    if like.framework == "cupy":
        return _cupy().cuda.Device(like.cuda_index)
    if like.on_cuda:
        return _torch().cuda.device(like.device)
    return contextlib.nullcontext()


def _xp(like: _Array) -> Any:
    """The NumPy-like module of a NumPy or CuPy array."""
    return _cupy() if like.framework == "cupy" else np


def _as_int(value: Any, what: str, op: str, minimum: int) -> int:
    if isinstance(value, bool):
        _fail(op, f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        _fail(op, f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if number < minimum:
        _fail(op, f"{what} must be >= {minimum}, got {number}")
    return number


def _as_float(value: Any, what: str, op: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        _fail(op, f"{what} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):
        _fail(op, f"{what} must be finite, got {number}")
    return number


class Routing:
    """Where every (token, choice) goes: see docs/moe_kernels.md.

    Attributes: ``indices`` (T, k), ``locations`` (T, k) int64, ``counts``
    (E,) int64 kept per expert, ``offsets`` (E + 1,) int64 first row of each
    expert, ``capacity`` (None for the dropless layout of ``permute``),
    ``num_rows``, ``num_dropped``, ``num_tokens``, ``top_k``,
    ``num_experts``; ``row_map`` (T, k) is the row each choice occupies
    (-1 when not kept).
    """

    def __init__(self, indices: _Array, locations, counts, offsets, capacity, num_rows, num_dropped, num_experts):
        self._indices = indices
        self.indices = indices.array
        self.locations = locations
        self.counts = counts
        self.offsets = offsets
        self.capacity = capacity
        self.num_rows = num_rows
        self.num_dropped = num_dropped
        self.num_experts = num_experts
        self.num_tokens, self.top_k = indices.shape

    @property
    def dropless(self) -> bool:
        return self.capacity is None

    @property
    def row_map(self) -> Any:
        e = self.indices
        if self._indices.framework == "torch":
            torch = _torch()
            e = e.long()
            safe = e.clamp(min=0)
            kept = (e >= 0) & (self.locations < self.counts[safe])
            return torch.where(kept, self.offsets[safe] + self.locations, torch.full_like(self.locations, -1))
        xp = _xp(self._indices)
        with _device_guard(self._indices):
            e = e.astype(xp.int64)
            safe = xp.maximum(e, 0)
            kept = (e >= 0) & (self.locations < self.counts[safe])
            return xp.where(kept, self.offsets[safe] + self.locations, -1)

    def _native(self) -> tuple:
        return (
            self.num_tokens,
            self.top_k,
            self.num_experts,
            self._indices.address,
            DTYPE_CODES[self._indices.dtype],
            address_of(self.locations),
            address_of(self.counts),
            address_of(self.offsets),
            _DROPLESS if self.capacity is None else self.capacity,
            self.num_rows,
        )

    def __repr__(self) -> str:
        layout = "dropless" if self.capacity is None else f"capacity={self.capacity}"
        return (
            f"a2a.Routing(num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"{layout}, num_rows={self.num_rows}, num_dropped={self.num_dropped}, on {self._indices.place()})"
        )


def _check_indices(indices: Any, op: str) -> _Array:
    # A private copy: the kernels trust the routing, so a later change to the
    # caller's array must not reach them.
    if is_torch_tensor(indices):
        private = indices.clone()
    elif is_cupy_array(indices):
        with indices.device:  # the copy lands on the current device
            private = indices.copy()
    else:
        private = np.array(indices, copy=True)
    idx = _Array(private, "indices", op)
    if len(idx.shape) != 2 or idx.dtype not in _INDICES:
        _fail(op, f"indices must be a 2-D (tokens, top_k) array of int32 or int64; got {idx.describe()}")
    if idx.shape[1] == 0:
        _fail(op, f"indices has top_k == 0 ({idx.describe()}); every token needs at least one choice")
    return idx


def _token_order(scores: Any, idx: _Array, op: str) -> Any:
    """Batch Prioritized Routing: tokens by descending score (their row
    maximum), ties in token order."""
    if scores is None:
        _fail(op, "batch_prioritized=True needs scores (tokens,) or (tokens, n)")
    s = _Array(scores, "scores", op)
    _same_place(op, idx, s)
    num_tokens = idx.shape[0]
    if len(s.shape) not in (1, 2) or s.shape[0] != num_tokens or (len(s.shape) == 2 and s.shape[1] == 0):
        _fail(op, f"scores must be (tokens,) or (tokens, n) with tokens = {num_tokens}; got {s.describe()}")
    if s.framework == "torch":
        torch = _torch()
        priority = s.array if len(s.shape) == 1 else s.array.amax(dim=1)
        return torch.argsort(priority.detach(), descending=True, stable=True).contiguous()
    xp = _xp(s)
    with _device_guard(s):
        priority = s.array if len(s.shape) == 1 else s.array.max(axis=1)
        return xp.ascontiguousarray(xp.argsort(-priority.astype(xp.float64), kind="stable").astype(xp.int64))


def route(
    indices: Any,
    num_experts: int,
    *,
    capacity: int | None = None,
    capacity_setting: float | None = None,
    scores: Any = None,
    batch_prioritized: bool = False,
    comm: Comm | None = None,
) -> Routing:
    """Slots for a gate's top-k choices (Tutel's routing).

    ``indices`` (T, k) int32/int64: the expert of every choice; negative means
    not routed. ``capacity`` fixes the rows per expert; otherwise
    ``capacity_setting`` x (default 1.0): x > 0 gives ceil(k*x*T/E), x == 0
    the smallest capacity that drops nothing, x < 0 like 0 but at most
    ceil(k*(-x)*T/E). All first choices take slots before any second choice;
    ``batch_prioritized=True`` orders tokens by descending ``scores``. With
    ``comm`` the call is collective and the capacity is the maximum over the
    ranks. Choices beyond the capacity are dropped (``num_dropped``).
    """
    op = "route"
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"{op}: comm must be an a2a.Comm, got {type(comm).__name__}")
    try:
        idx = _check_indices(indices, op)
        num_experts = _as_int(num_experts, "num_experts", op, 1)
        if capacity is not None and capacity_setting is not None:
            _fail(op, "pass either capacity or capacity_setting, not both")
        if capacity is not None:
            capacity = _as_int(capacity, "capacity", op, 1)
        setting = 1.0 if capacity_setting is None else _as_float(capacity_setting, "capacity_setting", op)
        order = _token_order(scores, idx, op) if batch_prioritized else None
    except Exception as error:
        if comm is None:
            raise
        # Every rank must learn of it (they raise RemoteError) instead of waiting.
        message = str(error).removeprefix(f"{op}: ")
        if not isinstance(error, InvalidArgumentError):
            message = f"{type(error).__name__}: {message}"
        comm._native.report_invalid(op, f"{op} on rank {comm.rank} of {comm.size}: {message}")
        raise  # not reached: report_invalid raises
    return _route(idx, num_experts, capacity or 0, setting, order, comm, op)


def _route(idx: _Array, num_experts: int, capacity: int, setting: float, order: Any, comm, op: str) -> Routing:
    num_tokens, top_k = idx.shape
    execution = _exec(idx)
    locations = _empty(idx, (num_tokens, top_k), "int64")
    counts = _empty(idx, (num_experts,), "int64")
    offsets = _empty(idx, (num_experts + 1,), "int64")
    workspace = _empty(idx, (_C.route_workspace_size(execution, num_tokens, top_k, num_experts),), "uint8")
    with _device_guard(idx):
        final_capacity, num_rows, num_dropped = _C.route(
            execution,
            None if comm is None else comm._native,
            idx.address,
            DTYPE_CODES[idx.dtype],
            num_tokens,
            top_k,
            num_experts,
            0 if order is None else address_of(order),
            capacity,
            setting,
            address_of(workspace),
            workspace.nbytes,
            address_of(locations),
            address_of(counts),
            address_of(offsets),
        )
    return Routing(
        idx, locations, counts, offsets, None if final_capacity < 0 else final_capacity, num_rows, num_dropped,
        num_experts,
    )


# --- the kernels, without autograd (a2a.torch wraps these) ---------------------------------


def _check_routing(routing: Any, op: str) -> Routing:
    if not isinstance(routing, Routing):
        raise TypeError(f"{op}: routing must be an a2a.Routing (from a2a.route or a2a.permute), got {type(routing).__name__}")
    return routing


def _check_data(x: Any, what: str, op: str, rows: int, routing: Routing) -> _Array:
    a = _Array(x, what, op)
    _same_place(op, routing._indices, a)
    if len(a.shape) != 2 or a.shape[0] != rows or a.dtype not in _FLOATS:
        _fail(op, f"{what} must be ({rows}, model_dim) of float32, float64, float16 or bfloat16; got {a.describe()}")
    return a


def _check_gates(gates: Any, op: str, routing: Routing, data: _Array) -> _Array | None:
    if gates is None:
        return None
    g = _Array(gates, "gates", op)
    _same_place(op, data, g)
    shape = (routing.num_tokens, routing.top_k)
    if g.shape != shape or g.dtype not in ("float32", data.dtype):
        _fail(op, f"gates must be {shape} of float32 or {data.dtype} (the data's dtype); got {g.describe()}")
    return g


def _output(out: Any, like: _Array, shape: tuple[int, ...], op: str) -> Any:
    """A new (shape) array like `like`, or `out` after checking it."""
    if out is None:
        return _empty(like, shape, like.dtype)
    o = _Array(out, "out", op)
    if o.array is not out or (is_torch_tensor(out) and out.requires_grad):
        _fail(op, "out must be C-contiguous, writeable and not require grad")
    if (o.framework, o.device, o.dtype) != (like.framework, like.device, like.dtype) or int(np.prod(o.shape)) != int(
        np.prod(shape)
    ):
        _fail(op, f"out is {o.describe()}; expected a {like.place()} array of {int(np.prod(shape))} {like.dtype} elements")
    if o.framework == "numpy" and not out.flags.writeable:
        _fail(op, "out is read-only")
    return out


def _gated_kernel(kernel, data: Any, what: str, rows_in: int, rows_out: int, routing: Routing, gates: Any, op: str,
                  out: Any) -> Any:
    """Runs a dispatch or combine kernel: data (rows_in, M) -> (rows_out, M)."""
    a = _check_data(data, what, op, rows_in, routing)
    g = _check_gates(gates, op, routing, a)
    result = _output(out, a, (rows_out, a.shape[1]), op)
    with _device_guard(a):
        kernel(
            _exec(a), routing._native(), a.address, DTYPE_CODES[a.dtype], a.shape[1],
            0 if g is None else g.address, DTYPE_CODES[g.dtype if g else a.dtype], address_of(result),
        )
    return result


def _dispatch(x: Any, routing: Routing, gates: Any, op: str, out: Any = None) -> Any:
    """rows (num_rows, M): rows[row(t, j)] = gate * x[t], padding zeroed."""
    return _gated_kernel(_C.moe_dispatch, x, "x", routing.num_tokens, routing.num_rows, routing, gates, op, out)


def _combine(rows: Any, routing: Routing, gates: Any, op: str, out: Any = None) -> Any:
    """y (T, M): y[t] = sum_j gate * rows[row(t, j)]."""
    return _gated_kernel(_C.moe_combine, rows, "rows", routing.num_rows, routing.num_tokens, routing, gates, op, out)


def _gate_grad(tokens: Any, rows: Any, routing: Routing, gate_dtype: str, op: str) -> Any:
    """(T, k) of gate_dtype: dot(tokens[t], rows[row(t, j)]), 0 when not kept."""
    t = _check_data(tokens, "tokens", op, routing.num_tokens, routing)
    r = _check_data(rows, "rows", op, routing.num_rows, routing)
    if (t.dtype, t.shape[1]) != (r.dtype, r.shape[1]):
        _fail(op, f"tokens ({t.describe()}) and rows ({r.describe()}) differ in dtype or model_dim")
    grad = _empty(t, (routing.num_tokens, routing.top_k), gate_dtype)
    with _device_guard(t):
        _C.moe_gate_grad(
            _exec(t), routing._native(), t.address, r.address, DTYPE_CODES[t.dtype], t.shape[1], DTYPE_CODES[gate_dtype],
            address_of(grad),
        )
    return grad


def _needs_autograd(*arrays: Any) -> bool:
    if not any(is_torch_tensor(a) and a.requires_grad for a in arrays):
        return False
    return _torch().is_grad_enabled()


def _padded(routing: Any, op: str) -> Routing:
    routing = _check_routing(routing, op)
    if routing.capacity is None:
        _fail(op, "this routing is dropless (from a2a.permute); use a2a.permute / a2a.unpermute with it")
    return routing


def _dispatched_rows(dispatched: Any, routing: Routing, op: str) -> Any:
    """The (E, C, M) buffer as (E*C, M), checking its shape."""
    shape = tuple(dispatched.shape)
    E, C = routing.num_experts, routing.capacity
    if len(shape) != 3 or shape[:2] != (E, C):
        _fail(op, f"dispatched must be (num_experts, capacity, model_dim) = ({E}, {C}, M); got shape {shape}")
    return dispatched.reshape(E * C, shape[2])


def _no_out_with_autograd(out: Any, op: str) -> None:
    if out is not None:
        _fail(op, "out= cannot be used while recording autograd (inputs require grad)")


def fast_encode(x: Any, routing: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """x (T, M) -> dispatched (E, C, M): ``dispatched[e, loc] = g * x[t]`` for
    every kept choice (g = 1 without gates: apply them at decode), unused
    slots zero."""
    op = "fast_encode"
    routing = _padded(routing, op)
    if _needs_autograd(x, gates):
        _no_out_with_autograd(out, op)
        from . import torch as a2a_torch

        return a2a_torch.fast_encode(x, routing, gates)
    rows = _dispatch(x, routing, gates, op, out)
    return rows.reshape(routing.num_experts, routing.capacity, x.shape[1])


def fast_decode(dispatched: Any, routing: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """dispatched (E, C, M) -> y (T, M): ``y[t] = sum_k g_k * dispatched[e_k, loc_k]``
    over kept choices, accumulated in float32 (float64 for float64)."""
    op = "fast_decode"
    routing = _padded(routing, op)
    if _needs_autograd(dispatched, gates):
        _no_out_with_autograd(out, op)
        from . import torch as a2a_torch

        return a2a_torch.fast_decode(dispatched, routing, gates)
    y = _combine(_dispatched_rows(dispatched, routing, op), routing, gates, op, out)
    return y.reshape(routing.num_tokens, dispatched.shape[2])


def permute(x: Any, indices: Any, num_experts: int, *, out: Any = None) -> tuple[Any, Routing]:
    """Dropless dispatch: x (T, M) -> (x_sorted (N, M), perm). Rows are
    grouped by expert (expert e owns rows perm.offsets[e] .. perm.offsets[e+1]-1,
    perm.counts[e] of them), in Tutel's slot order; N is the number of routed
    choices. Nothing is dropped and nothing is padded."""
    op = "permute"
    perm = _permutation(indices, num_experts, op)
    if _needs_autograd(x):
        _no_out_with_autograd(out, op)
        from . import torch as a2a_torch

        return a2a_torch.permute(x, perm)
    rows = _dispatch(x, perm, None, op, out)
    return rows.reshape(perm.num_rows, x.shape[1]), perm


def _permutation(indices: Any, num_experts: Any, op: str) -> Routing:
    """The dropless routing of permute."""
    idx = _check_indices(indices, op)
    return _route(idx, _as_int(num_experts, "num_experts", op, 1), _DROPLESS, 0.0, None, None, op)


def unpermute(y_sorted: Any, perm: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """Dropless combine: y_sorted (N, M) -> (T, M), the gate-weighted sum of
    each token's rows."""
    op = "unpermute"
    perm = _check_routing(perm, op)
    if perm.capacity is not None:
        _fail(op, "this routing has a capacity (from a2a.route); use a2a.fast_decode with it")
    if _needs_autograd(y_sorted, gates):
        _no_out_with_autograd(out, op)
        from . import torch as a2a_torch

        return a2a_torch.unpermute(y_sorted, perm, gates)
    y = _combine(y_sorted, perm, gates, op, out)
    return y.reshape(perm.num_tokens, y_sorted.shape[1])
