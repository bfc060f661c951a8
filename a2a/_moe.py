"""Tutel's fast encode / decode and the dropless permute / unpermute.

``fast_encode`` scatters tokens into the (E, C, M) buffer that the
all-to-all moves (the ragged (sum of C_e, M) buffer with per-expert
capacities C_e) and ``fast_decode`` gathers them back with the gates (the
routing comes from ``a2a.route``); ``permute`` / ``unpermute`` do the same
without a capacity (rows packed by expert, for ``all_to_all_v``).
docs/moe_kernels.md shows the layouts.

Inputs are C-contiguous NumPy arrays, torch tensors (CPU, or CUDA when the
CUDA backend is built; then the kernels run on the current torch stream) or
CuPy arrays (on the current CuPy stream), all beside the routing; a
non-contiguous one is an error, never copied. Outputs have the framework and
device of the inputs, or go to ``out=`` (C-contiguous, the result's dtype,
element count and device; returned with the result's shape). With torch
tensors that require grad the ops record autograd through a2a.torch (and
take no ``out=``), all but ``gate_grad``, a backward's kernel, which never
records.
"""

from __future__ import annotations

from typing import Any

from . import _fp8
from ._arrays import argument_view, is_torch_tensor, records_autograd, torch_dtype_named
from ._errors import InvalidArgumentError
from ._moe_kernels import combine, dispatch, dispatched_rows, dispatched_shape
from ._moe_kernels import gate_grad as _gate_grad
from ._routing import Routing, permutation, require_dropless, require_padded, require_routing

__all__ = ["fast_decode", "fast_encode", "gate_grad", "permute", "unpermute"]


def _records_autograd(op: str, out: Any, *arrays: Any) -> bool:
    """Whether a torch input requires grad while grad mode is on (then the op
    goes through a2a.torch, which cannot write into out=)."""
    if not records_autograd(*arrays):
        return False
    if out is not None:
        raise InvalidArgumentError(f"{op}: out= cannot be used while recording autograd (inputs require grad)")
    return True


def fast_encode(x: Any, routing: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """x (T, M) -> dispatched (E, C, M): ``dispatched[e, loc] = g * x[t]`` for
    every kept choice (g = 1 without gates: apply them at decode), unused
    slots zero. ``gates`` (T, k) are float32 or x's dtype. With per-expert
    capacities the result is (num_rows, M): ``dispatched[offsets[e] + loc]``.
    x may be an FP8 pair (q, scales) from ``quantize_fp8`` (no gates): each
    row moves with its scales, and the result is a pair of the same kind."""
    op = "fast_encode"
    routing = require_padded(routing, op)
    if _fp8.is_fp8_pair(x):
        return _encoded_pair(x, routing, gates, op, out, dispatched_shape)
    if _records_autograd(op, out, x, gates):
        from . import torch as autograd

        return autograd.fast_encode(x, routing, gates)
    rows = dispatch(x, routing, gates, op, out)
    return rows.reshape(dispatched_shape(routing, rows.shape[1]))


def fast_decode(dispatched: Any, routing: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """dispatched (E, C, M) -> y (T, M): ``y[t] = sum_k g_k * dispatched[e_k, loc_k]``
    over kept choices, accumulated in float32 (float64 for float64).
    ``dispatched`` is (num_rows, M) with per-expert capacities."""
    op = "fast_decode"
    routing = require_padded(routing, op)
    if _records_autograd(op, out, dispatched, gates):
        from . import torch as autograd

        return autograd.fast_decode(dispatched, routing, gates)
    return combine(dispatched_rows(dispatched, routing, op), routing, gates, op, out, what="dispatched")


def gate_grad(tokens: Any, dispatched: Any, routing: Routing, *, dtype: str | None = None, out: Any = None) -> Any:
    """(T, k): ``grad[t, j] = dot(tokens[t], row of choice (t, j))`` for every
    kept choice, 0 for a dropped one, accumulated in float32 (float64 for
    float64) and stored as ``dtype``: float32 or the tokens' dtype (the
    default). It is the gates' gradient of both kernels (Tutel's K2):
    fast_decode's from the output's gradient (``tokens`` = dy, ``dispatched``
    = the rows it decoded), and fast_encode's from the gradient of what it
    encoded (``tokens`` = x, ``dispatched`` = d dispatched). ``dispatched``
    is fast_decode's (E, C, M) or (num_rows, M); with a dropless ``routing``
    (from ``permute``), the (N, M) rows. Records no autograd: it is a
    backward's kernel, for callers that write their own (a2a.torch's nodes
    run it)."""
    op = "gate_grad"
    require_routing(routing, "routing", op)
    rows = dispatched if routing.dropless else dispatched_rows(dispatched, routing, op)
    own = torch_dtype_named(tokens.dtype)[0] if is_torch_tensor(tokens) else argument_view(tokens, "tokens", op).dtype_name
    if dtype is None:
        dtype = own
    elif dtype not in ("float32", own):
        raise InvalidArgumentError(f"{op}: dtype must be float32 or the tokens' dtype ({own}); got {dtype!r}")
    return _gate_grad(tokens, rows, routing, dtype, op, out, what="dispatched")


def permute(x: Any, indices: Any, num_experts: int, *, out: Any = None, wait: bool = True) -> tuple[Any, Routing]:
    """Dropless dispatch: x (T, M) -> (x_sorted (N, M), perm). Rows are
    grouped by expert (expert e owns rows perm.offsets[e] .. perm.offsets[e+1]-1,
    perm.counts[e] of them), in Tutel's slot order; N is the number of routed
    choices. Nothing is dropped and nothing is padded. ``indices`` as for
    ``a2a.route``. x may be an FP8 pair (q, scales), as for fast_encode.

    ``wait=False``: nothing comes back to the host, so on a GPU the call only
    enqueues kernels (a CUDA graph may capture it): N is T * k, a bound, and
    where some choices are not routed the rows past the routed ones are the
    last expert's, zeroed (perm.offsets[E] = T * k, perm.counts as before).
    For a top-k's indices, every choice routed, that is the layout of
    ``wait=True`` itself. ``perm.host_counts`` is None; an index >=
    num_experts is not routed meanwhile and raised when ``perm.num_dropped``
    is first read (always 0 otherwise), as for ``route(..., wait=False)``."""
    op = "permute"
    perm = permutation(indices, num_experts, op, wait)
    if _fp8.is_fp8_pair(x):
        return _encoded_pair(x, perm, None, op, out, lambda r, width: (r.num_rows, width)), perm
    if _records_autograd(op, out, x):
        from . import torch as autograd

        return autograd.permute(x, perm)
    return dispatch(x, perm, None, op, out), perm


def unpermute(y_sorted: Any, perm: Routing, gates: Any = None, *, out: Any = None) -> Any:
    """Dropless combine: y_sorted (N, M) -> (T, M), the gate-weighted sum of
    each token's rows (``perm`` from ``permute``)."""
    op = "unpermute"
    perm = require_dropless(perm, op)
    if _records_autograd(op, out, y_sorted, gates):
        from . import torch as autograd

        return autograd.unpermute(y_sorted, perm, gates)
    return combine(y_sorted, perm, gates, op, out, what="y_sorted")


def _encoded_pair(pair: Any, routing: Routing, gates: Any, op: str, out: Any, shape_of: Any) -> tuple[Any, Any]:
    """fast_encode / permute of an FP8 pair: its packed rows move as bytes, the
    codes and scales of each row together, and come back as a pair."""
    if gates is not None:
        raise InvalidArgumentError(f"{op}: an FP8 pair takes no gates; apply them at the combine")
    if out is not None:
        raise InvalidArgumentError(f"{op}: out= is not taken with an FP8 pair")
    packed = _fp8.packed_rows(pair, op)
    q, scales = pair
    model_dim, blocks = q.shape[-1], scales.shape[-1]
    rows = dispatch(packed.reshape(-1, packed.shape[-1]), routing, None, op, what="the FP8 pair's packed rows")
    rows = rows.reshape(shape_of(routing, packed.shape[-1]))
    return _fp8.unpack_views(rows, model_dim, blocks, _fp8.format_of_codes(q))
