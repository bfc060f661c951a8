"""torch.autograd versions of a2a's collectives and MoE kernels (CPU and CUDA tensors).

Collectives: ``all_to_all``, ``all_to_all_flex``, ``all_to_all_v``,
``all_gather``, ``reduce_scatter``, ``all_gather_v``, ``reduce_scatter_v``
and ``all_reduce`` take the arguments of the functions of the same name in
``a2a`` except ``out=`` (all_gather takes it: the gathered rows go into it
and still record autograd). Each backward is the adjoint collective of the
gradient (all_to_all: itself; all_to_all_flex: the axes swapped;
all_to_all_v: the rows sent back; all_gather and reduce_scatter: each other,
and so are all_gather_v and reduce_scatter_v, with the same counts;
all_reduce: itself); only the sum reductions differentiate. Backward is collective: every rank must run it, in the same
order, which holds when every rank runs the same graph (a rank that records
while another does not waits in its backward for a collective the other never
calls).
The backward passes record too, so double backward works. docs/moe_kernels.md
has the table.

MoE kernels: ``fast_encode``, ``fast_decode``, ``permute`` and ``unpermute``
take the same arguments as the functions of the same name in ``a2a`` and
differentiate with respect to the data and the gates. The backward passes are
the same sparse kernels (docs/moe_kernels.md): encode's data gradient is a
combine, decode's a dispatch, and the gate gradient is a per-choice dot
product (Tutel's K2). Routings (from ``a2a.route`` / ``a2a.permute``) carry no
gradient.

The fused gate: ``top_k_gate`` as in ``a2a``, differentiable in the logits
through its gates and loss; its backward is ``a2a.top_k_gate_backward``.

Expert-specific operators: ``esmm``, ``ess`` and ``estmm`` as in ``a2a``,
differentiable in their data, weights, biases and gates; every backward is
made of the same three operators.

``a2a.all_to_all(x, ...)`` and the other functions of ``a2a`` come here by
themselves when a torch input requires grad while grad mode is on.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _collectives
from ._errors import InvalidArgumentError
from ._moe_kernels import combine, dispatch, dispatched_rows, dispatched_shape, gate_grad
from ._routing import Routing, permutation, require_dropless, require_padded
from ._torch_collectives import *  # the collectives, named in _collectives.COLLECTIVES
from ._torch_es_ops import esmm, ess, estmm
from ._torch_gating import top_k_gate

__all__ = [
    "esmm",
    "ess",
    "estmm",
    "fast_decode",
    "fast_encode",
    "permute",
    "top_k_gate",
    "unpermute",
]
__all__.extend(_collectives.COLLECTIVES)


class _GatedKernel(torch.autograd.Function):
    """out = dispatch(data, gates) (encode, permute) or combine(data, gates)
    (decode, unpermute). Each is the other's data gradient with the same
    gates; the gate gradient pairs every token with its row, whichever side
    holds which."""

    @staticmethod
    def forward(ctx, data, gates, routing, op, dispatching, what, buffers=(None, None)):
        # The buffers (out=, grad_buffer=) travel in a tuple: as tensor
        # arguments autograd would take them for inputs.
        out, grad_buffer = buffers
        ctx.routing, ctx.op, ctx.dispatching, ctx.grad_buffer = routing, op, dispatching, grad_buffer
        ctx.save_for_backward(data, gates)
        return (dispatch if dispatching else combine)(data, routing, gates, op, out, what=what)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        data, gates = ctx.saved_tensors
        routing, op = ctx.routing, f"{ctx.op} (backward)"
        grad_out = grad_out.contiguous()  # autograd may hand in expanded or strided gradients
        grad_data = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_data = (combine if ctx.dispatching else dispatch)(grad_out, routing, gates, op, ctx.grad_buffer)
        if gates is not None and ctx.needs_input_grad[1]:
            tokens, rows = (data, grad_out) if ctx.dispatching else (grad_out, data)
            grad_gates = gate_grad(tokens, rows, routing, str(gates.dtype).removeprefix("torch."), op)
        return grad_data, grad_gates, None, None, None, None, None


def fast_encode(x: torch.Tensor, routing: Routing, gates: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, M) -> dispatched (E, C, M), or (num_rows, M) with per-expert
    capacities; see a2a.fast_encode.

    ``out=`` (a buffer that does not require grad, as for a2a.fast_encode)
    receives the result, which still records autograd: the backward reads
    ``x`` and ``gates``, never the output, so reusing the buffer after this
    call cannot change the gradients."""
    routing = require_padded(routing, "fast_encode")
    if isinstance(out, torch.Tensor) and out.requires_grad:
        raise InvalidArgumentError("fast_encode: out= must not require grad")
    rows = _GatedKernel.apply(x, gates, routing, "fast_encode", True, "x", (out, None))
    return rows.view(dispatched_shape(routing, rows.shape[1]))


def fast_decode(dispatched: torch.Tensor, routing: Routing, gates: torch.Tensor | None = None, *,
                grad_buffer: torch.Tensor | None = None) -> torch.Tensor:
    """dispatched (E, C, M), or (num_rows, M) with per-expert capacities -> y (T, M);
    see a2a.fast_decode.

    ``grad_buffer=`` (a contiguous tensor of dispatched's shape, dtype and
    device that does not require grad) receives dispatched's gradient in the
    backward instead of a new (E, C, M) tensor: a training loop that passes
    the same buffer every step keeps the biggest gradient of a MoE layer out
    of the allocator. The gradient handed on to dispatched's producer is then
    the buffer itself, so the caller must not write the buffer again until
    that gradient has been used (until the step's backward has finished)."""
    routing = require_padded(routing, "fast_decode")
    rows = dispatched_rows(dispatched, routing, "fast_decode")
    if grad_buffer is not None:
        _check_grad_buffer(grad_buffer, dispatched, "fast_decode")
        if gates is not None and _overlap(grad_buffer, dispatched):
            raise InvalidArgumentError("fast_decode: grad_buffer overlaps dispatched, which the backward reads for "
                                       "the gates' gradient after writing dispatched's gradient into grad_buffer")
    return _GatedKernel.apply(rows, gates, routing, "fast_decode", False, "dispatched", (None, grad_buffer))


def _check_grad_buffer(buffer: Any, like: torch.Tensor, op: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgumentError(f"{op}: grad_buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.requires_grad:
        raise InvalidArgumentError(f"{op}: grad_buffer must not require grad")
    if (buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device
            or not buffer.is_contiguous()):
        raise InvalidArgumentError(
            f"{op}: grad_buffer is a {'' if buffer.is_contiguous() else 'non-contiguous '}{tuple(buffer.shape)} "
            f"{buffer.dtype} tensor on {buffer.device}; expected a contiguous {tuple(like.shape)} {like.dtype} "
            f"tensor on {like.device} (dispatched's)"
        )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    first_a, first_b = a.data_ptr(), b.data_ptr()
    return first_a < first_b + b.numel() * b.element_size() and first_b < first_a + a.numel() * a.element_size()


def permute(x: torch.Tensor, indices: Any, num_experts: int | None = None, *,
            wait: bool = True) -> tuple[torch.Tensor, Routing]:
    """(x_sorted, perm) as a2a.permute (``wait`` too). ``indices`` may also be a dropless
    Routing from an earlier permute (then num_experts is not needed)."""
    if isinstance(indices, Routing):
        perm = require_dropless(indices, "permute", what="indices")
    elif num_experts is None:
        raise InvalidArgumentError("permute: num_experts is required with indices")
    else:
        perm = permutation(indices, num_experts, "permute", wait)
    return _GatedKernel.apply(x, None, perm, "permute", True, "x"), perm


def unpermute(y_sorted: torch.Tensor, perm: Routing, gates: torch.Tensor | None = None) -> torch.Tensor:
    """(N, M) -> (T, M) as a2a.unpermute."""
    perm = require_dropless(perm, "unpermute")
    return _GatedKernel.apply(y_sorted, gates, perm, "unpermute", False, "y_sorted")
