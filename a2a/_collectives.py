"""The collectives: all_to_all, all_to_all_flex, all_to_all_v, the dense
ones, and plans. These record no autograd: a2a's public functions
(a2a._collective_api) come here, or to a2a.torch when a torch input requires
grad.

Every function is collective over ``comm`` and blocking. Arguments that must
agree across ranks are checked on every call; a rank whose input is invalid
raises InvalidArgumentError and every other rank raises RemoteError (nobody
hangs). Outputs are allocated with the input's framework unless ``out=`` is
given.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _C
from ._arrays import (
    ArrayView,
    check_out,
    check_supported,
    empty_like,
    is_torch_tensor,
    records_autograd,
    view,
)
from ._comm import Comm
from ._counters import note_allocation
from ._errors import A2AError, InvalidArgumentError, MismatchError
from ._torch_exchange import torch_exchange

# The collectives by name, written once: defined here (plain), in
# a2a._torch_collectives (autograd) and a2a._collective_api (public), and
# exported by a2a and a2a.torch, whose lists are all built from this one.
COLLECTIVES = (
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_flex",
    "all_to_all_v",
    "reduce_scatter",
    "reduce_scatter_v",
)

__all__ = ["ALGORITHMS", "COLLECTIVES", "REDUCE_OPS", "VPlan", "plan_v"]
__all__.extend(COLLECTIVES)

ALGORITHMS = {"linear": 0, "2dh": 1}
REDUCE_OPS = {"sum": 0, "max": 1, "min": 2}  # a2a_reduce_op_t
_MAX_COUNT = 2**62  # rows per peer; the core's int64 byte counts overflow far above any real count
_ALGO_NAMES = ("linear", "2dh")  # a tuple: `in` must not hash an unhashable algo


def _reject(comm: Comm, op: str, message: str) -> None:
    """Fails `op` on every rank: the others raise RemoteError, this rank raises
    InvalidArgumentError with `message`."""
    comm._native.report_invalid(op, f"{op} on rank {comm.rank} of {comm.size}: {message}")


class _ReportToAllRanks:
    """Context for the local work before a collective: any unexpected
    exception in it (a ragged count list, an allocation failure, a torch
    tensor that has no data pointer) is reported to every rank like bad input,
    instead of leaving the other ranks waiting."""

    def __init__(self, comm: Comm, op: str):
        self.comm, self.op = comm, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or isinstance(error, A2AError) or not isinstance(error, Exception):
            return False
        _reject(self.comm, self.op, f"{type(error).__name__}: {error}")
        return False  # not reached: _reject raises


def _numpy_call(x: Any, out: Any, comm: Any, algo: Any) -> bool:
    """Whether a call may try its native NumPy fast path (host NumPy arrays on
    a host comm, a known algorithm); the fast path returns None for anything
    else unusual, and the general path then checks and reports it."""
    return (
        type(x) is np.ndarray
        and (out is None or type(out) is np.ndarray)
        and type(comm) is Comm
        and comm.cuda_device is None
        and algo in _ALGO_NAMES
    )


def _check_comm(comm: Any, op: str) -> None:
    if not isinstance(comm, Comm):
        raise TypeError(f"{op}: comm must be an a2a.Comm, got {type(comm).__name__}")


def _prepare(comm: Comm, op: str, x: Any, algo: str) -> ArrayView:
    """Checks what only Python can see (the object, its dtype and layout, the
    algorithm name) and reports a problem to every rank."""
    reason = None
    v = None
    try:
        v = view(x, "input")
        reason = check_supported(v, "input")
    except (InvalidArgumentError, TypeError) as error:  # TypeError: not an array
        reason = str(error)
    if reason is None and (not isinstance(algo, str) or algo not in ALGORITHMS):
        reason = f"unknown algo {algo!r}; expected one of {sorted(ALGORITHMS)}"
    if reason is None:
        reason = comm._bind(v)
    if reason is not None:
        _reject(comm, op, reason)
    return v


def _require_rows(comm: Comm, op: str, v: ArrayView) -> None:
    """Rejects a 0-d input: the collective splits or stacks along dim 0."""
    if len(v.shape) == 0:
        _reject(comm, op, f"input {v.describe()} is 0-d; it needs a row dimension")


def _require_rows_per_rank(comm: Comm, op: str, v: ArrayView) -> None:
    """Rejects an input whose dim 0 does not split into one block per rank."""
    if len(v.shape) == 0 or v.shape[0] % comm.size != 0:
        dim0 = v.shape[0] if v.shape else "none (a 0-d array)"
        _reject(comm, op, f"input {v.describe()}: dim 0 ({dim0}) is not divisible by the world size {comm.size}")


def _output(comm: Comm, op: str, v: ArrayView, shape: tuple[int, ...], out: Any) -> tuple[Any, ArrayView]:
    if out is None:
        result = empty_like(v, shape)
        return result, view(result, "out")
    o, reason = check_out(out, v, shape)
    if reason is not None:
        _reject(comm, op, reason)
    return out, o


def all_to_all(x: Any, *, comm: Comm, algo: str = "linear", out: Any = None) -> Any:
    """All-to-all along dim 0: ``MPI_Alltoall`` / ``torch.distributed.all_to_all_single``.

    ``x`` has shape ``(size * n, ...)``: rows ``[i*n, (i+1)*n)`` go to rank i,
    and the result (same shape and dtype) holds rank j's rows at ``[j*n, (j+1)*n)``.

    ``algo``: ``"linear"`` (Tutel Algorithm 1) or ``"2dh"`` (Tutel Algorithm 2,
    intra-node then inter-node; bitwise identical output).
    """
    op = "all_to_all"
    if _numpy_call(x, out, comm, algo):
        result = comm._native.all_to_all_numpy(x, out, ALGORITHMS[algo], comm._workspace)
        if result is not None:
            if out is None:
                note_allocation()
            return result
    if algo in _ALGO_NAMES and type(comm) is Comm and is_torch_tensor(x) and x.dim() and x.shape[0] % comm.size == 0:
        count = x.numel() // comm.size
        with _ReportToAllRanks(comm, op):
            fast = torch_exchange(x, out, comm, tuple(x.shape), lambda code: comm._native.all_to_all_workspace_size(
                count, code, ALGORITHMS[algo]))
        if fast is not None:
            result, address, out_address, code, ws, ws_bytes = fast
            comm._native.all_to_all(address, out_address, count, code, ALGORITHMS[algo], ws, ws_bytes)
            return result
    # The general path: any framework, and every error reported to every rank.
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, algo)
        _require_rows_per_rank(comm, op, v)
        result, o = _output(comm, op, v, v.shape, out)
        count = v.nbytes // v.itemsize // comm.size
        algo_code = ALGORITHMS[algo]
        ws, ws_bytes = comm.workspace(comm._native.all_to_all_workspace_size(count, v.dtype_code, algo_code), v)
    comm._native.all_to_all(v.address, o.address, count, v.dtype_code, algo_code, ws, ws_bytes)
    return result


def _normalize_axis(axis: Any, ndim: int) -> int | None:
    """The axis in [0, ndim), or None for anything that is no integer in [-ndim, ndim) (1.7, "1", True)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        return None
    a = int(axis)
    if -ndim <= a < ndim:
        return a % ndim
    return None


def all_to_all_flex(x: Any, *, comm: Comm, split_axis: int, concat_axis: int, algo: str = "linear", out: Any = None) -> Any:
    """All-to-all with JAX ``lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`` semantics.

    ``x.shape[split_axis]`` is split into ``size`` blocks; block i goes to
    rank i; the received blocks are concatenated along ``concat_axis`` in rank
    order. The result has ``shape[split_axis] / size`` and
    ``shape[concat_axis] * size``. The shape must be equal on every rank.

    MoE dispatch: (E, C, M) -> (E/W, W*C, M) with split_axis=0, concat_axis=1;
    combine back with split_axis=1, concat_axis=0. With the linear algorithm
    over MPI, the layout change travels as MPI datatypes (no extra copy).
    """
    op = "all_to_all_flex"
    if (
        _numpy_call(x, out, comm, algo)
        and type(split_axis) is int
        and type(concat_axis) is int
        and -x.ndim <= split_axis < x.ndim
        and -x.ndim <= concat_axis < x.ndim
    ):
        result = comm._native.all_to_all_flex_numpy(
            x, out, split_axis % x.ndim, concat_axis % x.ndim, ALGORITHMS[algo], comm._workspace
        )
        if result is not None:
            if out is None:
                note_allocation()
            return result
    if (algo in _ALGO_NAMES and type(comm) is Comm and is_torch_tensor(x) and type(split_axis) is int
            and type(concat_axis) is int and -x.dim() <= split_axis < x.dim() and -x.dim() <= concat_axis < x.dim()
            and x.shape[split_axis] % comm.size == 0):
        split, concat, dims = split_axis % x.dim(), concat_axis % x.dim(), list(x.shape)
        shape = list(dims)
        shape[split] //= comm.size
        shape[concat] *= comm.size
        with _ReportToAllRanks(comm, op):
            fast = torch_exchange(x, out, comm, tuple(shape), lambda code: comm._native.all_to_all_flex_workspace_size(
                dims, split, concat, code, ALGORITHMS[algo]))
        if fast is not None:
            result, address, out_address, code, ws, ws_bytes = fast
            comm._native.all_to_all_flex(address, out_address, dims, split, concat, code, ALGORITHMS[algo], ws,
                                         ws_bytes)
            return result
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, algo)
        ndim = len(v.shape)
        split, concat = _normalize_axis(split_axis, ndim), _normalize_axis(concat_axis, ndim)
        if split is None or concat is None:
            bad = "split_axis" if split is None else "concat_axis"
            value = split_axis if split is None else concat_axis
            _reject(comm, op, f"{bad}={value!r} is out of range: it takes an integer in [-{ndim}, {ndim}) for "
                              f"{v.describe()}")
        if v.shape[split] % comm.size != 0:
            _reject(
                comm,
                op,
                f"input {v.describe()}: dimension {split} ({v.shape[split]}) is not divisible by the world size "
                f"{comm.size}",
            )
        shape = list(v.shape)
        shape[split] //= comm.size
        shape[concat] *= comm.size
        result, o = _output(comm, op, v, tuple(shape), out)
        algo_code = ALGORITHMS[algo]
        try:
            ws_bytes = comm._native.all_to_all_flex_workspace_size(list(v.shape), split, concat, v.dtype_code, algo_code)
        except InvalidArgumentError as error:  # e.g. too many dims: tell the other ranks too
            _reject(comm, op, str(error))
        ws, ws_bytes = comm.workspace(ws_bytes, v)
    comm._native.all_to_all_flex(v.address, o.address, list(v.shape), split, concat, v.dtype_code, algo_code, ws, ws_bytes)
    return result


def _counts_list(send_counts: Any) -> list[int] | None:
    if type(send_counts) is list and all(type(c) is int for c in send_counts):
        return send_counts
    if is_torch_tensor(send_counts):
        send_counts = send_counts.detach().cpu().numpy()
    counts = np.asarray(send_counts)
    if counts.ndim != 1 or not (np.issubdtype(counts.dtype, np.integer) or counts.size == 0):
        return None
    return [int(c) for c in counts]


def all_to_all_v(x: Any, send_counts: Any, *, comm: Comm, algo: str = "linear", out: Any = None) -> tuple[Any, np.ndarray]:
    """Uneven all-to-all along dim 0 (``MPI_Alltoallv``), counts found inside.

    ``send_counts[i]`` rows of ``x`` (consecutive, in rank order) go to rank
    i; ``sum(send_counts) == x.shape[0]``. Returns ``(recv, recv_counts)``:
    ``recv`` has ``sum(recv_counts)`` rows (rank j's rows first for smaller j)
    and the trailing shape of ``x``; ``recv_counts`` is a NumPy int64 array.
    Trailing dims must agree across ranks. Zero counts and empty inputs work.

    With ``algo="linear"`` over MPI the call is one round: the counts travel
    as the sizes of the data messages. Elsewhere (2DH, NCCL) the counts go
    first, in a round of their own; when the same counts serve several calls,
    :func:`plan_v` exchanges them once. An ``out=`` whose rows differ from
    ``sum(recv_counts)`` fails on this rank alone (the rows are dropped; the
    other ranks complete), since only the exchange tells the count.
    """
    op = "all_to_all_v"
    if _numpy_call(x, out, comm, algo):
        # Latency matters here: the native call checks well-formed NumPy
        # input, its counts and out= itself, and agrees on the rest. out= of
        # other rows than arrive fails on this rank alone (above); of another
        # row shape or dtype, on the general path, on every rank.
        started = comm._native.all_to_all_v_numpy(x, send_counts, _MAX_COUNT, out, ALGORITHMS[algo], comm._workspace)
        if started is not None:
            result, recv_counts, exchange = started
            if out is None:
                note_allocation(2)  # the rows and their counts
            if exchange is not None:  # out= of other rows, or a workspace to grow
                result = _finish_v(comm, op, exchange, int(recv_counts.sum()), view(x, "input"), out)
            return result, recv_counts
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, algo)
        counts = _checked_counts(comm, op, v, send_counts, require_rows=True)
        if out is not None:  # all but its rows, which only the exchange tells
            shape = tuple(getattr(out, "shape", ()))
            if hasattr(out, "dtype") and (len(shape) != len(v.shape) or shape[1:] != tuple(v.shape[1:])):
                expected = ", ".join(["N", *map(str, v.shape[1:])])
                _reject(comm, op, f"out has shape {shape}; expected shape ({expected}), N the rows that arrive "
                        f"(input {v.describe()})")
            _output(comm, op, v, (shape[0] if shape else 0, *v.shape[1:]), out)
    exchange = _C.VExchange(comm._native, v.address, counts, math.prod(v.shape[1:]), v.dtype_code, ALGORITHMS[algo])
    recv_counts = np.array(exchange.recv_counts, dtype=np.int64)
    return _finish_v(comm, op, exchange, int(recv_counts.sum()), v, out), recv_counts


def _finish_v(comm: Comm, op: str, exchange: Any, rows: int, v: ArrayView, out: Any) -> Any:
    """Receives an exchange's `rows` rows into out= (or a new array). Errors
    here are this rank's alone: the exchange is dropped, the other ranks
    complete."""
    try:
        shape = (rows, *v.shape[1:])
        if out is None:
            result = empty_like(v, shape)
            o = view(result, "out")
        else:
            o, reason = check_out(out, v, shape)
            if reason is not None:
                raise InvalidArgumentError(
                    f"{op} on rank {comm.rank} of {comm.size}: {reason} (the {rows} rows sent here were dropped; "
                    "the other ranks completed)"
                )
            result = out
        ws, ws_bytes = comm.workspace(exchange.workspace_size, v)
    except BaseException:
        exchange.drop()
        raise
    exchange.finish(o.address, ws, ws_bytes)
    return result


def plan_v(send_counts: Any, *, like: Any, comm: Comm, algo: str = "linear") -> VPlan:
    """Plans uneven all-to-alls with fixed counts (collective): the counts are
    exchanged once here, and every :meth:`VPlan.run` moves only the data.

    ``send_counts[i]`` rows go to rank i. ``like`` is an array with the
    dtype, framework and row shape (``shape[1:]``) of the inputs the plan
    will run on, e.g. the first of them. dtype, row size and ``algo`` must
    agree across ranks. ``plan.recv_counts`` (NumPy int64) says how many rows
    arrive from each rank.
    """
    return _plan_v("plan_v", send_counts, like, comm, algo, require_rows=False)


class VPlan:
    """A reusable uneven all-to-all (:func:`plan_v`): fixed counts, any data."""

    def __init__(self, comm: Comm, native: Any, like: ArrayView, send_counts: list[int], algo: str):
        self.comm = comm
        self.algo = algo
        # Read-only: the plan was made for these counts, and a change would show in repr but not in run.
        self.send_counts = np.array(send_counts, dtype=np.int64)
        self.recv_counts = np.array(native.recv_counts, dtype=np.int64)
        self.send_counts.flags.writeable = self.recv_counts.flags.writeable = False
        self.row_shape = tuple(like.shape[1:])
        self.dtype = like.dtype_name
        self._native = native
        self._framework = like.framework
        self._dtype_code = like.dtype_code
        self._rows_in = int(self.send_counts.sum())
        self._rows_out = int(self.recv_counts.sum())

    def run(self, x: Any, *, out: Any = None) -> Any:
        """Collective: sends ``send_counts[i]`` rows of ``x`` to rank i and
        returns the ``sum(recv_counts)`` rows received, rank j's before rank
        j+1's. ``x`` has ``sum(send_counts)`` rows and the planned row shape
        and dtype; ``out=`` takes the result's place.

        A plan records no autograd: a torch ``x`` that requires grad while
        grad mode is on is an error (a2a.all_to_all_v differentiates)."""
        comm = self.comm
        if (
            self._framework == "numpy"
            and comm.cuda_device is None
            and type(x) is np.ndarray
            and (out is None or type(out) is np.ndarray)
            and x.shape[1:] == self.row_shape
        ):
            result = self._native.execute_numpy(
                x, out, self._rows_in, self._rows_out, self._dtype_code, comm._workspace
            )
            if result is not None:
                if out is None:
                    note_allocation()
                return result
        op = "all_to_all_v"
        with _ReportToAllRanks(comm, op):
            v = _prepare(comm, op, x, self.algo)
            if records_autograd(x):
                _reject(
                    comm,
                    op,
                    f"input {v.describe()} requires grad while grad mode is on, and a plan records no autograd: "
                    "use a2a.all_to_all_v (or a2a.torch.all_to_all_v), or run the plan under torch.no_grad()",
                )
            if v.framework != self._framework or v.dtype_name != self.dtype or tuple(v.shape[1:]) != self.row_shape:
                _reject(
                    comm,
                    op,
                    f"input {v.describe()} does not fit the plan (a {self._framework} array of rows {self.row_shape} "
                    f"and dtype {self.dtype})",
                )
            if v.shape[0] != self._rows_in:
                _reject(comm, op, f"input {v.describe()} has {v.shape[0]} rows but the plan sends {self._rows_in}")
            result, o = _output(comm, op, v, (self._rows_out, *self.row_shape), out)
            ws, ws_bytes = comm.workspace(self._native.workspace_size, v)
        self._native.execute(v.address, o.address, ws, ws_bytes)
        return result

    def __repr__(self) -> str:
        return (
            f"a2a.VPlan(send_counts={self.send_counts.tolist()}, recv_counts={self.recv_counts.tolist()}, "
            f"row_shape={self.row_shape}, dtype={self.dtype}, algo={self.algo})"
        )


def _plan_v(op: str, send_counts: Any, x: Any, comm: Comm, algo: str, *, require_rows: bool) -> VPlan:
    """Checks the counts against x (and x's rows against their sum when x is
    the input itself), then makes the native plan: the collective count
    exchange, which also checks that dtype, algo and row width agree."""
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, algo)
        counts = _checked_counts(comm, op, v, send_counts, require_rows=require_rows)
    native = _C.VPlan(comm._native, counts, math.prod(v.shape[1:]), v.dtype_code, ALGORITHMS[algo])
    return VPlan(comm, native, v, counts, algo)


def _checked_counts(comm: Comm, op: str, v: ArrayView, send_counts: Any, *, require_rows: bool) -> list[int]:
    """send_counts as a list of ints, checked against the world and (where x
    is the input itself) x's rows; a problem fails every rank."""
    _require_rows(comm, op, v)
    counts = _required_counts(comm, op, send_counts, "send_counts", "one per rank")
    if require_rows and sum(counts) != v.shape[0]:
        _reject(comm, op, f"send_counts sum to {sum(counts)} rows but the input {v.describe()} has {v.shape[0]} rows")
    return counts


# ---------------------------------------------------------------------------
# Dense collectives


def _reduce_op_code(comm: Comm, name: str, op: Any) -> int:
    if not isinstance(op, str) or op not in REDUCE_OPS:
        _reject(comm, name, f"unknown op {op!r}; expected one of {sorted(REDUCE_OPS)}")
    return REDUCE_OPS[op]


def all_gather(x: Any, *, comm: Comm, out: Any = None) -> Any:
    """``torch.distributed.all_gather_into_tensor`` / ``MPI_Allgather`` along dim 0.

    Every rank passes ``x`` of the same shape ``(n, ...)``; the result has
    shape ``(size * n, ...)`` with rank i's ``x`` at rows ``[i*n, (i+1)*n)``.
    """
    op = "all_gather"
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, "linear")
        _require_rows(comm, op, v)
        result, o = _output(comm, op, v, (comm.size * v.shape[0], *v.shape[1:]), out)
    comm._native.all_gather(v.address, o.address, v.nbytes // v.itemsize, v.dtype_code)
    return result


def all_reduce(x: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    """``MPI_Allreduce`` / ``torch.distributed.all_reduce``: element-wise
    ``op`` ("sum", "max", "min") of ``x`` over ranks, same shape and dtype.

    ``out=x`` reduces in place. float16 and bfloat16 are reduced in float32
    and rounded back at every step (as NCCL does).
    """
    name = "all_reduce"
    _check_comm(comm, name)
    with _ReportToAllRanks(comm, name):
        v = _prepare(comm, name, x, "linear")
        code = _reduce_op_code(comm, name, op)
        result, o = _output(comm, name, v, v.shape, out)
    comm._native.all_reduce(v.address, o.address, v.nbytes // v.itemsize, v.dtype_code, code)
    return result


def reduce_scatter(x: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    """``torch.distributed.reduce_scatter_tensor`` / ``MPI_Reduce_scatter_block``
    along dim 0: ``x`` has shape ``(size * n, ...)``; rank i gets the
    element-wise ``op`` over ranks of rows ``[i*n, (i+1)*n)``, shape ``(n, ...)``.
    """
    name = "reduce_scatter"
    _check_comm(comm, name)
    with _ReportToAllRanks(comm, name):
        v = _prepare(comm, name, x, "linear")
        code = _reduce_op_code(comm, name, op)
        _require_rows_per_rank(comm, name, v)
        result, o = _output(comm, name, v, (v.shape[0] // comm.size, *v.shape[1:]), out)
    comm._native.reduce_scatter(v.address, o.address, v.nbytes // v.itemsize // comm.size, v.dtype_code, code)
    return result


def _required_counts(comm: Comm, op: str, given: Any, name: str, meaning: str) -> list[int]:
    """`given` as one integer in [0, _MAX_COUNT] per rank, or a failure of
    every rank naming the argument (`name`) and what its entries are."""
    if is_torch_tensor(given) and given.is_cuda and comm.predicts_check:
        comm.check()  # the counts' copy to the host waits for the stream, which may hold a predicted call's work
    counts = _counts_list(given)
    if counts is None or len(counts) != comm.size:
        _reject(comm, op, f"{name} must be {comm.size} integers ({meaning}), got {given!r}")
    if any(c < 0 for c in counts):
        _reject(comm, op, f"{name} has negative entries: {counts}")
    if any(c > _MAX_COUNT for c in counts):
        _reject(comm, op, f"{name} has entries above {_MAX_COUNT}: {counts}")
    return counts


def _dense_counts(comm: Comm, op: str, counts: Any, v: ArrayView) -> tuple[list[int], list[int]]:
    """(rows, elements) per rank: ``counts`` checked (one non-negative integer
    per rank) and scaled by ``v``'s row size, every problem reported to every
    rank. Equality across ranks is the core's check."""
    rows = _required_counts(comm, op, counts, "counts", "rows of each rank")
    row = math.prod(v.shape[1:])
    elements = [c * row for c in rows]
    if sum(elements) > _MAX_COUNT:
        _reject(comm, op, f"counts {rows} of rows of {row} elements overflow")
    return rows, elements


def _run_v(call: Any, v: ArrayView) -> None:
    """Runs the native call; the core compares counts in elements, so a
    mismatch it reports says how rows became elements here."""
    try:
        call()
    except MismatchError as error:
        row = math.prod(v.shape[1:])
        if row == 1 or "'counts' differ" not in str(error):
            raise
        raise MismatchError(f"{error} (counts in elements: this rank's rows x {row} elements per row)") from error


def all_gather_v(x: Any, counts: Any, *, comm: Comm, out: Any = None) -> Any:
    """``MPI_Allgatherv`` along dim 0: rank i contributes ``counts[i]`` rows.

    ``counts`` (a list, NumPy array or tensor of ``size`` integers, zeros
    allowed) must be the same on every rank; ``x`` has shape
    ``(counts[rank], ...)`` with the same row shape on every rank. The result
    has shape ``(sum(counts), ...)``, rank i's rows starting at row
    ``counts[0] + ... + counts[i-1]``. Counts that differ across ranks raise
    MismatchError on every rank.
    """
    op = "all_gather_v"
    _check_comm(comm, op)
    with _ReportToAllRanks(comm, op):
        v = _prepare(comm, op, x, "linear")
        _require_rows(comm, op, v)
        rows, elements = _dense_counts(comm, op, counts, v)
        if v.shape[0] != rows[comm.rank]:
            _reject(comm, op, f"input {v.describe()} has {v.shape[0]} rows but counts[{comm.rank}] is {rows[comm.rank]}")
        result, o = _output(comm, op, v, (sum(rows), *v.shape[1:]), out)
    _run_v(lambda: comm._native.all_gather_v(v.address, o.address, elements, v.dtype_code), v)
    return result


def reduce_scatter_v(x: Any, counts: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    """``MPI_Reduce_scatter`` along dim 0: rank i gets the element-wise ``op``
    ("sum", "max", "min") over ranks of its block of ``counts[i]`` rows.

    ``counts`` (``size`` integers, zeros allowed) must be the same on every
    rank; ``x`` has shape ``(sum(counts), ...)``, rank i's block starting at
    row ``counts[0] + ... + counts[i-1]``. The result has shape
    ``(counts[rank], ...)``. float16 and bfloat16 are reduced as in
    :func:`all_reduce`. Counts that differ across ranks raise MismatchError
    on every rank.
    """
    name = "reduce_scatter_v"
    _check_comm(comm, name)
    with _ReportToAllRanks(comm, name):
        v = _prepare(comm, name, x, "linear")
        code = _reduce_op_code(comm, name, op)
        _require_rows(comm, name, v)
        rows, elements = _dense_counts(comm, name, counts, v)
        if v.shape[0] != sum(rows):
            _reject(comm, name, f"input {v.describe()} has {v.shape[0]} rows but counts sum to {sum(rows)}")
        result, o = _output(comm, name, v, (rows[comm.rank], *v.shape[1:]), out)
    _run_v(lambda: comm._native.reduce_scatter_v(v.address, o.address, elements, v.dtype_code, code), v)
    return result
