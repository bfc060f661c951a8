"""The public collectives: the plain call (a2a._collectives), or, when a
torch input requires grad while grad mode is on, the autograd one
(a2a._torch_collectives, public as a2a.torch), as a2a's MoE kernels do.

The autograd functions are imported only when a call records, so a2a never
imports torch itself; NumPy arrays go straight to the plain call and its
fast path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _collectives, _fp8
from ._arrays import records_autograd
from ._bytes import bytes_of
from ._comm import Comm
from ._errors import A2AError, InvalidArgumentError

__all__ = list(_collectives.COLLECTIVES)

_RECORDING = """
    With a torch tensor that requires grad while grad mode is on, the call
    records autograd: it is ``a2a.torch.{name}``, whose backward is a
    collective too (every rank must run it), and ``out=`` is an error, raised
    on every rank.
"""

_PAIRS = """
    x may be an FP8 pair (q, scales) from ``a2a.quantize_fp8``: its packed
    rows are exchanged once, each row's codes with its scales, and the result
    is a pair of the same kind (``out=``: such a pair, written in place).
"""


def _documented_as(plain: Callable, pairs: bool = False) -> Callable[[Callable], Callable]:
    """Gives the public function the plain call's docstring, plus what
    recording autograd changes (and what an FP8 pair does, for `pairs`)."""

    def document(public: Callable) -> Callable:
        if plain.__doc__ is not None:  # None under python -OO
            public.__doc__ = (plain.__doc__.rstrip() + "\n" + _RECORDING.format(name=plain.__name__)
                              + (_PAIRS if pairs else ""))
        return public

    return document


def _autograd(op: str, comm: Any, out: Any) -> Any:
    """a2a.torch's collectives, for a call that records autograd (they
    allocate their outputs: out= fails on every rank)."""
    from . import _torch_collectives

    if out is not None:
        _torch_collectives.report_invalid(
            comm,
            op,
            "out= cannot be used while recording autograd (a torch input requires grad and grad mode is on)",
        )
    return _torch_collectives


def _exchanged_pair(op: str, comm: Comm, pair: Any, out: Any, exchange: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """An FP8 pair's packed rows exchanged once as bytes (exchange(packed,
    packed out or None)), back as a pair. A bad pair fails on every rank, as
    a bad array does."""
    try:
        packed = _fp8.packed_rows(pair, op)
        packed_out = None if out is None else _fp8.packed_rows_of(out, "out", op)
    except (InvalidArgumentError, TypeError) as error:
        _collectives._reject(comm, op, str(error))
        raise
    received = exchange(packed, packed_out)
    if type(out) is _fp8.Fp8Pair:
        return out  # the views of what was just written
    q, scales = pair
    return _fp8.unpack_views(received, q.shape[-1], scales.shape[-1], _fp8.format_of_codes(q))


def _as_bytes(op: str, comm: Comm, moved: tuple[Any, Callable[[Any], Any]], x: Any, out: Any,
              exchange: Callable[[Any, Any], Any]) -> Any:
    """x of a dtype a2a moves as bytes (a2a/_bytes.py): exchange(x's bytes, out's bytes or None), the
    result in x's dtype (`out` itself when given). An out= of another dtype fails on every rank."""
    data, back = moved
    into = None
    if out is not None:
        same = type(out) is type(x) and getattr(out, "dtype", None) == x.dtype
        into = bytes_of(out) if same else None
        if into is None:
            _collectives._reject(comm, op, f"out must be a C-contiguous {type(x).__name__} of the input's dtype "
                                 f"{x.dtype}; got {type(out).__name__} of {getattr(out, 'dtype', None)}")
    try:
        received = exchange(data, None if into is None else into[0])
    except A2AError as error:  # it names the bytes: say whose they are
        whose = f"the input: {type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}, moved as its bytes"
        error.args = (f"{error.args[0]} ({whose})", *error.args[1:])
        raise
    return out if out is not None else back(received)


@_documented_as(_collectives.all_to_all, pairs=True)
def all_to_all(x: Any, *, comm: Comm, algo: str = "linear", out: Any = None) -> Any:
    moved = None if isinstance(x, tuple) else bytes_of(x)
    if moved is not None or isinstance(x, tuple):  # an FP8 pair's packed rows, or an array's bytes
        def exchange(data: Any, into: Any) -> Any:
            return _collectives.all_to_all(data, comm=comm, algo=algo, out=into)
        return _exchanged_pair("all_to_all", comm, x, out, exchange) if moved is None else \
            _as_bytes("all_to_all", comm, moved, x, out, exchange)
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_to_all", comm, out).all_to_all(x, comm=comm, algo=algo)
    return _collectives.all_to_all(x, comm=comm, algo=algo, out=out)


@_documented_as(_collectives.all_to_all_flex, pairs=True)
def all_to_all_flex(
    x: Any, *, comm: Comm, split_axis: int, concat_axis: int, algo: str = "linear", out: Any = None
) -> Any:
    if isinstance(x, tuple):
        def exchange(packed: Any, into: Any) -> Any:
            last = packed.ndim - 1
            if last in (split_axis % max(packed.ndim, 1), concat_axis % max(packed.ndim, 1)):
                _collectives._reject(comm, "all_to_all_flex", "an FP8 pair is split and concatenated along its rows, "
                                     f"not its last axis (split_axis {split_axis}, concat_axis {concat_axis})")
            return _collectives.all_to_all_flex(packed, comm=comm, split_axis=split_axis, concat_axis=concat_axis,
                                                algo=algo, out=into)
        return _exchanged_pair("all_to_all_flex", comm, x, out, exchange)
    if (moved := bytes_of(x)) is not None:  # the axes counted from the front: the bytes' axis comes last
        split, concat = (axis if (axis_ := _collectives._normalize_axis(axis, x.ndim)) is None else axis_
                         for axis in (split_axis, concat_axis))
        return _as_bytes("all_to_all_flex", comm, moved, x, out, lambda data, into: _collectives.all_to_all_flex(
            data, comm=comm, split_axis=split, concat_axis=concat, algo=algo, out=into))
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_to_all_flex", comm, out).all_to_all_flex(
            x, comm=comm, split_axis=split_axis, concat_axis=concat_axis, algo=algo
        )
    return _collectives.all_to_all_flex(
        x, comm=comm, split_axis=split_axis, concat_axis=concat_axis, algo=algo, out=out
    )


@_documented_as(_collectives.all_to_all_v, pairs=True)
def all_to_all_v(
    x: Any, send_counts: Any, *, comm: Comm, algo: str = "linear", out: Any = None
) -> tuple[Any, np.ndarray]:
    moved = None if isinstance(x, tuple) else bytes_of(x)
    if moved is not None or isinstance(x, tuple):  # an FP8 pair's packed rows, or an array's bytes
        counts: list[Any] = []

        def exchange(data: Any, into: Any) -> Any:
            received, received_counts = _collectives.all_to_all_v(data, send_counts, comm=comm, algo=algo, out=into)
            counts.append(received_counts)
            return received
        result = _exchanged_pair("all_to_all_v", comm, x, out, exchange) if moved is None else \
            _as_bytes("all_to_all_v", comm, moved, x, out, exchange)
        return result, counts[0]
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_to_all_v", comm, out).all_to_all_v(x, send_counts, comm=comm, algo=algo)
    return _collectives.all_to_all_v(x, send_counts, comm=comm, algo=algo, out=out)


@_documented_as(_collectives.all_gather)
def all_gather(x: Any, *, comm: Comm, out: Any = None) -> Any:
    if (moved := bytes_of(x)) is not None:
        return _as_bytes("all_gather", comm, moved, x, out,
                         lambda data, into: _collectives.all_gather(data, comm=comm, out=into))
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_gather", comm, out).all_gather(x, comm=comm)
    return _collectives.all_gather(x, comm=comm, out=out)


@_documented_as(_collectives.all_reduce)
def all_reduce(x: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_reduce", comm, out).all_reduce(x, comm=comm, op=op)
    return _collectives.all_reduce(x, comm=comm, op=op, out=out)


@_documented_as(_collectives.reduce_scatter)
def reduce_scatter(x: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("reduce_scatter", comm, out).reduce_scatter(x, comm=comm, op=op)
    return _collectives.reduce_scatter(x, comm=comm, op=op, out=out)


@_documented_as(_collectives.all_gather_v)
def all_gather_v(x: Any, counts: Any, *, comm: Comm, out: Any = None) -> Any:
    if (moved := bytes_of(x)) is not None:
        return _as_bytes("all_gather_v", comm, moved, x, out,
                         lambda data, into: _collectives.all_gather_v(data, counts, comm=comm, out=into))
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("all_gather_v", comm, out).all_gather_v(x, counts, comm=comm)
    return _collectives.all_gather_v(x, counts, comm=comm, out=out)


@_documented_as(_collectives.reduce_scatter_v)
def reduce_scatter_v(x: Any, counts: Any, *, comm: Comm, op: str = "sum", out: Any = None) -> Any:
    if type(x) is not np.ndarray and records_autograd(x):
        return _autograd("reduce_scatter_v", comm, out).reduce_scatter_v(x, counts, comm=comm, op=op)
    return _collectives.reduce_scatter_v(x, counts, comm=comm, op=op, out=out)
