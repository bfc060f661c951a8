"""The fused top-k gate's kernels on arrays (a2a_top_k_gate in a2a.h),
without autograd: ``a2a.top_k_gate`` (a2a/_gating.py) runs them, or
a2a.torch's node (a2a/_torch_gating.py) when torch logits record autograd.
a2a/_gating.py says what they compute."""

from __future__ import annotations

import operator
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
    torch_dtype_named,
    torch_launch,
)
from ._counters import note_allocation
from ._errors import InvalidArgumentError

__all__ = ["GATE_DTYPES", "top_k_gate_backward", "top_k_gate_kernel"]

GATE_DTYPES = FLOAT_DTYPES  # the logits of every float dtype the kernels take


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


_WORKSPACE_BYTES: dict[tuple[int, int], int] = {}  # (E, dtype code) -> bytes: asked once, not every step


def _workspace_bytes(gate: tuple[int, int, int, bool, int]) -> int:
    key = (gate[1], gate[4])
    bytes_ = _WORKSPACE_BYTES.get(key)
    if bytes_ is None:
        bytes_ = _WORKSPACE_BYTES[key] = _C.top_k_gate_workspace_size(gate)
    return bytes_


def _check_k(k: Any, num_experts: int, op: str) -> int:
    try:
        value = None if isinstance(k, bool) else operator.index(k)
    except TypeError:
        value = None
    if value is None or not 1 <= value <= num_experts:
        _fail(op, f"k must be an integer in 1..{num_experts} (the logits' experts); got {k!r}")
    return value


def _torch_gate(logits: Any) -> tuple[int, int | None] | None:
    """(dtype code, CUDA device or None) of torch logits that pass every check,
    told without a view; None for anything else (the general path reports it)."""
    if not (is_torch_tensor(logits) and logits.dim() == 2 and logits.is_contiguous() and not logits.is_neg()
            and logits.shape[1] >= 1):
        return None
    name, _ = torch_dtype_named(logits.dtype)
    if name not in GATE_DTYPES:
        return None
    if logits.is_cuda:
        return DTYPE_CODES[name], logits.get_device()
    return (DTYPE_CODES[name], None) if logits.device.type == "cpu" else None


def top_k_gate_kernel(logits: Any, k: int, *, normalize: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """top_k_gate without autograd."""
    op = "top_k_gate"
    placed = _torch_gate(logits)
    if placed is not None:
        num_tokens, num_experts = logits.shape[0], logits.shape[1]
        k = _check_k(k, num_experts, op)
        code, cuda_device = placed
        torch = _torch()
        dtype, device = logits.dtype, logits.device
        note_allocation(6)
        scores = torch.empty((num_tokens, num_experts), dtype=dtype, device=device)
        indices = torch.empty((num_tokens, k), dtype=torch.int64, device=device)
        gates = torch.empty((num_tokens, k), dtype=dtype, device=device)
        share = torch.empty((num_experts,), dtype=dtype, device=device)
        l_aux = torch.empty((), dtype=dtype, device=device)
        gate = (num_tokens, num_experts, k, bool(normalize), code)
        workspace = torch.empty((_workspace_bytes(gate),), dtype=torch.uint8, device=device)
        torch_launch(cuda_device, _C.top_k_gate, gate, logits.data_ptr(), scores.data_ptr(), indices.data_ptr(),
                     gates.data_ptr(), share.data_ptr(), l_aux.data_ptr(), workspace.data_ptr())
        return scores, indices, gates, share, l_aux
    v = _logits_view(logits, op)
    num_tokens, num_experts = v.shape
    k = _check_k(k, num_experts, op)
    gate = (num_tokens, num_experts, k, bool(normalize), v.dtype_code)
    with v.device_guard():
        scores = empty_like(v, (num_tokens, num_experts))
        indices = empty_like(v, (num_tokens, k), "int64")
        gates = empty_like(v, (num_tokens, k))
        share = empty_like(v, (num_experts,))
        l_aux = empty_like(v, ())
        workspace = empty_like(v, (_workspace_bytes(gate),), "uint8")
        _C.top_k_gate(v.execution(), gate, v.address, *(address_of(a) for a in (scores, indices, gates, share, l_aux,
                                                                                  workspace)))
    return scores, indices, gates, share, l_aux


def top_k_gate_backward(scores: Any, indices: Any, share: Any, d_gates: Any = None, d_l_aux: Any = None, *,
                        normalize: bool = False) -> Any:
    """The gradient of the logits (T, E) from top_k_gate's scores, indices and
    share, and the gradients of its gates (T, k) and l_aux (a scalar array),
    either None where none reached them; `normalize` as in the forward."""
    op = "top_k_gate_backward"
    placed = _torch_backward_placed(scores, indices, share, d_gates, d_l_aux)
    if placed is not None:
        num_tokens, num_experts = scores.shape[0], scores.shape[1]
        code, cuda_device = placed
        gate = (num_tokens, num_experts, indices.shape[1], bool(normalize), code)
        note_allocation()
        d_logits = _torch().empty((num_tokens, num_experts), dtype=scores.dtype, device=scores.device)
        torch_launch(cuda_device, _C.top_k_gate_backward, gate, scores.data_ptr(), indices.data_ptr(),
                     share.data_ptr(), 0 if d_gates is None else d_gates.data_ptr(),
                     0 if d_l_aux is None else d_l_aux.data_ptr(), d_logits.data_ptr())
        return d_logits
    s = _logits_view(scores, op, "scores")
    num_tokens, num_experts = s.shape
    i = argument_view(indices, "indices", op)
    if (len(i.shape) != 2 or i.shape[0] != num_tokens or not 1 <= i.shape[1] <= num_experts
            or i.dtype_name not in ("int64", "int32") or not i.same_place(s)):
        _fail(op, f"indices must be ({num_tokens}, k <= {num_experts}) of int64 beside scores ({s.describe()}); "
                  f"got {i.describe()}")
    if i.dtype_name == "int32":  # as JAX gives them without x64: widened (a copy)
        i = argument_view(i.obj.to(_torch().int64) if i.framework == "torch" else i.obj.astype("int64"), "indices", op)
    top_k = i.shape[1]
    arrays = [s, i, _beside(share, s, "share", (num_experts,), s.dtype_name, op)]
    for x, what, shape in ((d_gates, "d_gates", (num_tokens, top_k)), (d_l_aux, "d_l_aux", ())):
        arrays.append(None if x is None else _beside(x, s, what, shape, s.dtype_name, op))
    gate = (num_tokens, num_experts, top_k, bool(normalize), s.dtype_code)
    with s.device_guard():
        d_logits = empty_like(s, (num_tokens, num_experts))
        _C.top_k_gate_backward(s.execution(), gate, *(0 if v is None else v.address for v in arrays),
                               address_of(d_logits))
    return d_logits


def _logits_view(x: Any, op: str, what: str = "logits") -> ArrayView:
    v = argument_view(x, what, op)
    if len(v.shape) != 2 or v.shape[1] < 1 or v.dtype_name not in GATE_DTYPES:
        _fail(op, f"{what} must be (tokens, experts >= 1) of {', '.join(GATE_DTYPES)}; got {v.describe()}")
    return v


def _beside(x: Any, like: ArrayView, what: str, shape: tuple[int, ...], dtype: str, op: str) -> ArrayView:
    """The view of an input that must lie beside `like`, of `shape` and `dtype`."""
    v = argument_view(x, what, op)
    if not v.same_place(like) or tuple(v.shape) != shape or v.dtype_name != dtype:
        _fail(op, f"{what} must be {shape} of {dtype} beside scores ({like.describe()}); got {v.describe()}")
    return v


def _torch_backward_placed(scores: Any, indices: Any, share: Any, d_gates: Any,
                           d_l_aux: Any) -> tuple[int, int | None] | None:
    """_torch_gate's (dtype code, CUDA device) of the scores where the torch
    arguments pass every check of the general path, told without views (the
    autograd node's backward calls this every step); else None."""
    placed = _torch_gate(scores)
    if placed is None:
        return None
    torch = _torch()
    num_tokens, num_experts = scores.shape[0], scores.shape[1]
    dtype, device = scores.dtype, scores.device

    def fits(x: Any, shape: tuple[int, ...], x_dtype: Any) -> bool:
        return (is_torch_tensor(x) and x.dtype == x_dtype and x.device == device and x.is_contiguous()
                and not x.is_neg() and tuple(x.shape) == shape)

    if not (is_torch_tensor(indices) and indices.dim() == 2 and 1 <= indices.shape[1] <= num_experts):
        return None
    top_k = indices.shape[1]
    fitting = (fits(indices, (num_tokens, top_k), torch.int64) and fits(share, (num_experts,), dtype)
               and (d_gates is None or fits(d_gates, (num_tokens, top_k), dtype))
               and (d_l_aux is None or fits(d_l_aux, (), dtype)))
    return placed if fitting else None
