"""The MoE kernels of a2a._C as plain functions, without autograd: argument
checks, output allocation beside the input, and the call on the input's
device and current stream. ``dispatch`` scatters tokens into rows,
``combine`` gathers rows back into tokens, ``gate_grad`` is the gradient of
the gates (a per-choice dot product). The public ops (a2a._moe) and their
autograd (a2a.torch) are both built on these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from . import _C
from ._arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    ArrayView,
    _torch,
    address_of,
    argument_view,
    empty_like,
    is_torch_tensor,
    mark_written,
    read_only,
    recording_out,
    torch_dtype_named,
    torch_launch,
    torch_on,
)
from ._counters import note_allocation
from ._errors import InvalidArgumentError
from ._routing import Routing, native_routing, routing_view

__all__ = ["combine", "dispatch", "dispatched_rows", "dispatched_shape", "gate_grad"]


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


def _data(x: Any, what: str, op: str, rows: int, routing: Routing, dtypes: tuple[str, ...] = FLOAT_DTYPES) -> ArrayView:
    """A (rows, model_dim) array of one of `dtypes` beside the routing."""
    a = argument_view(x, what, op)
    place = routing_view(routing)
    if not a.same_place(place):
        _fail(op, f"{what} ({a.describe()}) is not where the routing is ({place.framework} on {place.device_text})")
    if len(a.shape) != 2 or a.shape[0] != rows or a.dtype_name not in dtypes:
        _fail(op, f"{what} must be ({rows}, model_dim) of {', '.join(dtypes)}; got {a.describe()}")
    return a


def _gates(gates: Any, op: str, routing: Routing, data: ArrayView) -> ArrayView | None:
    """(T, k) gates of float32 or the data's dtype, beside the data."""
    if gates is None:
        return None
    g = argument_view(gates, "gates", op)
    if not g.same_place(data):
        _fail(op, f"gates ({g.describe()}) are not where the data is ({data.describe()})")
    shape = (routing.num_tokens, routing.top_k)
    if g.shape != shape or g.dtype_name not in ("float32", data.dtype_name):
        dtypes = "float32" if data.dtype_name == "float32" else f"float32 or {data.dtype_name} (the data's dtype)"
        _fail(op, f"gates must be {shape} of {dtypes}; got {g.describe()}")
    return g


def _output(out: Any, like: ArrayView, shape: tuple[int, ...], op: str, dtype_name: str | None = None) -> Any:
    """A new array of `shape` beside `like`, or `out` after checking it: any
    C-contiguous, writeable array of `dtype_name` (default like's dtype) and
    the same element count."""
    dtype_name = dtype_name or like.dtype_name
    if out is None:  # (like's own dtype by its object: NumPy names no bfloat16)
        return empty_like(like, shape, None if dtype_name == like.dtype_name else dtype_name)
    o = argument_view(out, "out", op)
    recorded = recording_out(out)
    if recorded is not None:
        _fail(op, recorded)
    if not o.same_place(like) or o.dtype_name != dtype_name or math.prod(o.shape) != math.prod(shape):
        _fail(
            op,
            f"out is a {o.describe()}; expected a {like.framework} array on {like.device_text} of "
            f"{math.prod(shape)} {dtype_name} elements",
        )
    if not o.writeable:
        _fail(op, read_only(out, f"out ({o.describe()})"))
    mark_written(out)
    return o.obj


def _torch_place(x: Any, rows: int, routing: Routing, dtypes: tuple[str, ...]) -> tuple[int, int] | None:
    """(dtype code, model_dim) of a torch tensor that passes every check of
    _data, told without a view (a view costs microseconds, which a GPU step
    pays per kernel); None for anything else: the general path then checks
    it and reports what is wrong."""
    place = routing._indices
    if place.framework != "torch" or not is_torch_tensor(x) or x.dim() != 2 or x.shape[0] != rows:
        return None
    name, _ = torch_dtype_named(x.dtype)
    if name not in dtypes or not x.is_contiguous() or x.is_neg():
        return None
    if not torch_on(x, place.cuda_device):
        return None
    return DTYPE_CODES[name], x.shape[1]


def _torch_gates(gates: Any, routing: Routing, data: Any, data_code: int) -> int | None:
    """The dtype code of `gates` that pass _gates' checks beside torch `data`
    (of dtype code `data_code`), told without a view, else None."""
    # (shape by its parts: comparing a torch.Size with a tuple goes through torch's symbolic shapes, microseconds)
    if not (is_torch_tensor(gates) and gates.dim() == 2 and gates.shape[0] == routing.num_tokens
            and gates.shape[1] == routing.top_k and gates.is_contiguous() and not gates.is_neg()
            and gates.device == data.device):
        return None
    if gates.dtype == data.dtype:
        return data_code
    return DTYPE_CODES["float32"] if gates.dtype == _torch().float32 else None


def _torch_kernel(kernel: Callable, data: Any, rows_in: int, rows_out: int, routing: Routing, gates: Any,
                  dtypes: tuple[str, ...], out: Any) -> Any:
    """The kernel's result, new or `out`'s (rows_out, M) view, for torch tensors that pass every check
    (told without views); None for anything else."""
    placed = _torch_place(data, rows_in, routing, dtypes)
    if placed is None:
        return None
    code, model_dim = placed
    gate_code, gate_address = code, 0
    if gates is not None:
        gate_code = None if code == DTYPE_CODES["uint8"] else _torch_gates(gates, routing, data, code)
        if gate_code is None:
            return None
        gate_address = gates.data_ptr()
    if out is None:
        note_allocation()
        result = _torch().empty((rows_out, model_dim), dtype=data.dtype, device=data.device)
    else:
        result = _torch_out(out, data, rows_out, model_dim)
        if result is None:
            return None
    torch_launch(routing._indices.cuda_device, kernel, native_routing(routing), data.data_ptr(), code, model_dim,
                 gate_address, gate_code, result.data_ptr())
    return result


def _torch_out(out: Any, data: Any, rows: int, model_dim: int) -> Any:
    """`out` as (rows, model_dim) where it passes _output's checks beside torch `data` (told without a
    view): a contiguous tensor of data's dtype and device, of rows * model_dim elements, that does not
    require grad; else None."""
    if not (is_torch_tensor(out) and out.dtype == data.dtype and out.is_contiguous() and not out.is_neg()
            and not out.requires_grad
            and torch_on(out, data.get_device() if data.is_cuda else None)
            and out.numel() == rows * model_dim):
        return None
    mark_written(out)
    # Always a view, never `out` itself: an autograd Function returning a tensor that is not one of its
    # inputs would make the caller's buffer its output (requires_grad, a grad_fn).
    return out.view(rows, model_dim)


def _gated_kernel(kernel: Callable, data: Any, what: str, rows_in: int, rows_out: int, routing: Routing,
                  gates: Any, op: str, out: Any, dtypes: tuple[str, ...] = FLOAT_DTYPES) -> Any:
    """Runs a dispatch or combine kernel: data (rows_in, M) -> (rows_out, M)
    (out= reshaped to that)."""
    result = _torch_kernel(kernel, data, rows_in, rows_out, routing, gates, dtypes, out)
    if result is not None:
        return result
    a = _data(data, what, op, rows_in, routing, dtypes)
    if a.dtype_name == "uint8" and gates is not None:
        _fail(op, "rows of bytes (FP8 pairs) take no gates; apply them at the combine")
    g = _gates(gates, op, routing, a)
    result = _output(out, a, (rows_out, a.shape[1]), op)
    if out is not None:  # a new result has the shape already (a reshape would be one more op to dispatch)
        result = result.reshape(rows_out, a.shape[1])
    gate_view = a if g is None else g
    with a.device_guard():
        kernel(
            a.execution(), native_routing(routing), a.address, a.dtype_code, a.shape[1],
            0 if g is None else g.address, gate_view.dtype_code, address_of(result),
        )
    return result


def dispatch(x: Any, routing: Routing, gates: Any, op: str, out: Any = None, what: str = "x") -> Any:
    """rows (num_rows, M): rows[row(t, j)] = gate * x[t], padding zeroed.
    x may also be rows of bytes (uint8, M a multiple of 4, no gates): packed
    FP8 rows, copied bit for bit. `what` names x in errors."""
    return _gated_kernel(_C.moe_dispatch, x, what, routing.num_tokens, routing.num_rows, routing, gates, op, out,
                         (*FLOAT_DTYPES, "uint8"))


def combine(rows: Any, routing: Routing, gates: Any, op: str, out: Any = None, what: str = "rows") -> Any:
    """y (T, M): y[t] = sum_j gate * rows[row(t, j)]. `what` names rows in errors."""
    return _gated_kernel(_C.moe_combine, rows, what, routing.num_rows, routing.num_tokens, routing, gates, op, out)


def gate_grad(tokens: Any, rows: Any, routing: Routing, gate_dtype: str, op: str, out: Any = None,
              what: str = "rows") -> Any:
    """(T, k) of gate_dtype: dot(tokens[t], rows[row(t, j)]), 0 when not kept; into `out` when given.
    `what` names rows in errors."""
    placed = _torch_place(tokens, routing.num_tokens, routing, FLOAT_DTYPES)
    if placed is not None and out is None and _torch_place(rows, routing.num_rows, routing, FLOAT_DTYPES) == placed:
        code, model_dim = placed
        note_allocation()
        grad = _torch().empty((routing.num_tokens, routing.top_k), dtype=getattr(_torch(), gate_dtype),
                              device=tokens.device)
        torch_launch(routing._indices.cuda_device, _C.moe_gate_grad, native_routing(routing), tokens.data_ptr(),
                     rows.data_ptr(), code, model_dim, DTYPE_CODES[gate_dtype], grad.data_ptr())
        return grad
    t = _data(tokens, "tokens", op, routing.num_tokens, routing)
    r = _data(rows, what, op, routing.num_rows, routing)
    if (t.dtype_name, t.shape[1]) != (r.dtype_name, r.shape[1]):
        _fail(op, f"tokens ({t.describe()}) and {what} ({r.describe()}) differ in dtype or model_dim")
    shape = (routing.num_tokens, routing.top_k)
    grad = _output(out, t, shape, op, gate_dtype)
    if out is not None:
        grad = grad.reshape(shape)
    with t.device_guard():
        _C.moe_gate_grad(
            t.execution(), native_routing(routing), t.address, r.address, t.dtype_code, t.shape[1],
            DTYPE_CODES[gate_dtype], address_of(grad),
        )
    return grad


def dispatched_shape(routing: Routing, model_dim: int) -> tuple[int, ...]:
    """The dispatched buffer of a padded routing: (E, C, M) for one capacity,
    (num_rows, M) for per-expert capacities (the ragged layout)."""
    if routing.per_expert:
        return (routing.num_rows, model_dim)
    return (routing.num_experts, routing.capacity, model_dim)


def dispatched_rows(dispatched: Any, routing: Routing, op: str) -> Any:
    """The dispatched buffer of a padded routing as (num_rows, M) rows (a view)."""
    per_expert = routing.per_expert
    experts, capacity = routing.num_experts, None if per_expert else routing.capacity
    if (not per_expert and is_torch_tensor(dispatched) and dispatched.dim() == 3
            and dispatched.shape[0] == experts and dispatched.shape[1] == capacity and dispatched.is_contiguous()
            and torch_dtype_named(dispatched.dtype)[0] in FLOAT_DTYPES):  # told without a view
        return dispatched.view(experts * capacity, dispatched.shape[2])
    d = argument_view(dispatched, "dispatched", op)
    if per_expert:
        if len(d.shape) != 2 or d.shape[0] != routing.num_rows or d.dtype_name not in FLOAT_DTYPES:
            _fail(op, f"dispatched must be (num_rows, model_dim) = ({routing.num_rows}, M) of "
                      f"{', '.join(FLOAT_DTYPES)} (per-expert capacities); got {d.describe()}")
        return d.obj
    if len(d.shape) != 3 or d.shape[:2] != (experts, capacity) or d.dtype_name not in FLOAT_DTYPES:
        _fail(
            op,
            f"dispatched must be (num_experts, capacity, model_dim) = ({experts}, {capacity}, M) of "
            f"{', '.join(FLOAT_DTYPES)}; got {d.describe()}",
        )
    return d.obj.reshape(experts * capacity, d.shape[2])
