"""The fused top-k gate: what a top-k router computes from its logits, in one
native call forward and one backward (a2a_top_k_gate in a2a.h).

For logits (T, E) of float32, float64, float16 or bfloat16 (16-bit ones
computed in float32 and rounded where torch's ops on them round: the
scores, the chosen scores' sum, each gate)::

    scores  = softmax(logits, dim=1)                                  (T, E)
    indices = the k largest scores of each token, best first, ranked by
              their logits (the softmax's order, which a rounded score
              may blur); equal logits by the lower expert; a row of NaN
              scores (a NaN or infinite logit) chooses 0..k-1        (T, k) int64
    gates   = scores at indices, divided by max(their sum, eps)
              when normalize (eps: the dtype's machine epsilon)        (T, k)
    share   = the tokens' share of first choices per expert            (E,)
    l_aux   = E * sum_e mean_t(scores[:, e]) * share[e]   (GShard's loss)  ()

``top_k_gate_backward`` takes the gradients of the gates and of l_aux
(either may be None) and gives the logits'. Neither records autograd: a layer
wraps them in its own node (moe_runtime.gating.topk). On a GPU the forward is
three kernels and the backward one; neither reads anything back, so both can
be captured in a CUDA graph. NumPy, torch and CuPy arrays, on the arrays'
device (the current stream on CUDA).
"""

from __future__ import annotations

from typing import Any

from . import _C
from ._arrays import (
    DTYPE_CODES,
    ArrayView,
    _torch,
    argument_view,
    empty_like,
    is_torch_tensor,
    torch_dtype_named,
    torch_execution,
)
from ._counters import note_allocation
from ._errors import InvalidArgumentError

__all__ = ["top_k_gate", "top_k_gate_backward"]

GATE_DTYPES = ("float32", "float64", "float16", "bfloat16")


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
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
        _fail(op, f"k must be an integer in 1..{num_experts} (the logits' experts); got {k!r}")
    return k


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


def top_k_gate(logits: Any, k: int, *, normalize: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """(scores, indices, gates, share, l_aux) of logits (T, E) (module
    docstring); new arrays beside the logits, of their dtype."""
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
        execution, guard = torch_execution(cuda_device)
        with guard:
            _C.top_k_gate(execution, gate, logits.data_ptr(), scores.data_ptr(), indices.data_ptr(), gates.data_ptr(),
                          share.data_ptr(), l_aux.data_ptr(), workspace.data_ptr())
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
        _C.top_k_gate(v.execution(), gate, v.address, *(_address(a) for a in (scores, indices, gates, share, l_aux,
                                                                                workspace)))
    return scores, indices, gates, share, l_aux


def top_k_gate_backward(scores: Any, indices: Any, share: Any, d_gates: Any = None, d_l_aux: Any = None, *,
                        normalize: bool = False) -> Any:
    """The gradient of the logits (T, E) from top_k_gate's scores, indices and
    share, and the gradients of its gates (T, k) and l_aux (a scalar array),
    either None where none reached them; `normalize` as in the forward."""
    op = "top_k_gate_backward"
    if _torch_backward_ok(scores, indices, share, d_gates, d_l_aux):
        num_tokens, num_experts = scores.shape[0], scores.shape[1]
        code, cuda_device = _torch_gate(scores)
        gate = (num_tokens, num_experts, indices.shape[1], bool(normalize), code)
        note_allocation()
        d_logits = _torch().empty((num_tokens, num_experts), dtype=scores.dtype, device=scores.device)
        execution, guard = torch_execution(cuda_device)
        with guard:
            _C.top_k_gate_backward(execution, gate, scores.data_ptr(), indices.data_ptr(), share.data_ptr(),
                                   0 if d_gates is None else d_gates.data_ptr(),
                                   0 if d_l_aux is None else d_l_aux.data_ptr(), d_logits.data_ptr())
        return d_logits
    s = _logits_view(scores, op, "scores")
    num_tokens, num_experts = s.shape
    i = _beside(indices, s, "indices", None, "int64", op)
    top_k = _check_k(i.shape[1], num_experts, op) if len(i.shape) == 2 else 0
    _beside(indices, s, "indices", (num_tokens, top_k), "int64", op)
    _beside(share, s, "share", (num_experts,), s.dtype_name, op)
    if d_gates is not None:
        _beside(d_gates, s, "d_gates", (num_tokens, top_k), s.dtype_name, op)
    if d_l_aux is not None:
        _beside(d_l_aux, s, "d_l_aux", (), s.dtype_name, op)
    gate = (num_tokens, num_experts, top_k, bool(normalize), s.dtype_code)
    with s.device_guard():
        d_logits = empty_like(s, (num_tokens, num_experts))
        _C.top_k_gate_backward(s.execution(), gate, s.address, _address(indices), _address(share),
                               0 if d_gates is None else _address(d_gates),
                               0 if d_l_aux is None else _address(d_l_aux), _address(d_logits))
    return d_logits


def _logits_view(x: Any, op: str, what: str = "logits") -> ArrayView:
    v = argument_view(x, what, op)
    if len(v.shape) != 2 or v.shape[1] < 1 or v.dtype_name not in GATE_DTYPES:
        _fail(op, f"{what} must be (tokens, experts >= 1) of {', '.join(GATE_DTYPES)}; got {v.describe()}")
    return v


def _beside(x: Any, like: ArrayView, what: str, shape: tuple[int, ...] | None, dtype: str, op: str) -> ArrayView:
    """The view of an input that must lie beside `like`, of `shape` (None: any
    2-D shape) and `dtype`."""
    v = argument_view(x, what, op)
    shape_ok = len(v.shape) == 2 if shape is None else tuple(v.shape) == shape
    if not v.same_place(like) or not shape_ok or v.dtype_name != dtype:
        expected = "(tokens, k)" if shape is None else str(shape)
        _fail(op, f"{what} must be {expected} of {dtype} beside scores ({like.describe()}); got {v.describe()}")
    return v


def _address(x: Any) -> int:
    return x.data_ptr() if is_torch_tensor(x) else argument_view(x, "array", "top_k_gate").address


def _torch_backward_ok(scores: Any, indices: Any, share: Any, d_gates: Any, d_l_aux: Any) -> bool:
    """Whether torch arguments pass every check of the general path, told
    without views (the autograd node's backward calls this every step)."""
    if _torch_gate(scores) is None:
        return False
    torch = _torch()
    num_tokens, num_experts = scores.shape[0], scores.shape[1]
    dtype, device = scores.dtype, scores.device

    def fits(x: Any, shape: tuple[int, ...], x_dtype: Any) -> bool:
        return (is_torch_tensor(x) and x.dtype == x_dtype and x.device == device and x.is_contiguous()
                and not x.is_neg() and tuple(x.shape) == shape)

    if not (is_torch_tensor(indices) and indices.dim() == 2 and 1 <= indices.shape[1] <= num_experts):
        return False
    top_k = indices.shape[1]
    return (fits(indices, (num_tokens, top_k), torch.int64) and fits(share, (num_experts,), dtype)
            and (d_gates is None or fits(d_gates, (num_tokens, top_k), dtype))
            and (d_l_aux is None or fits(d_l_aux, (), dtype)))
