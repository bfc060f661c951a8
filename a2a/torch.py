"""torch.autograd versions of a2a's MoE kernels (CPU and CUDA tensors).

``fast_encode``, ``fast_decode``, ``permute`` and ``unpermute`` take the same
arguments as the functions of the same name in ``a2a`` and differentiate with
respect to the data and the gates. The backward passes are the same sparse
kernels (docs/moe_kernels.md): encode's data gradient is a combine, decode's a
dispatch, and the gate gradient is a per-choice dot product (Tutel's K2).
Routings (from ``a2a.route`` / ``a2a.permute``) carry no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _moe
from ._moe import Routing

__all__ = ["fast_decode", "fast_encode", "permute", "unpermute"]


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _Dispatch(torch.autograd.Function):
    """rows = dispatch(x, gates): encode and permute."""

    @staticmethod
    def forward(ctx, x, gates, routing, op):
        ctx.routing, ctx.op = routing, op
        ctx.save_for_backward(x, gates)
        return _moe._dispatch(x, routing, gates, op)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        x, gates = ctx.saved_tensors
        routing, op = ctx.routing, f"{ctx.op} (backward)"
        grad_x = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_x = _moe._combine(grad_rows, routing, gates, op)
        if gates is not None and ctx.needs_input_grad[1]:
            grad_gates = _moe._gate_grad(x, grad_rows, routing, _dtype_name(gates), op)
        return grad_x, grad_gates, None, None


class _Combine(torch.autograd.Function):
    """y = combine(rows, gates): decode and unpermute."""

    @staticmethod
    def forward(ctx, rows, gates, routing, op):
        ctx.routing, ctx.op = routing, op
        ctx.save_for_backward(rows, gates)
        return _moe._combine(rows, routing, gates, op)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        rows, gates = ctx.saved_tensors
        routing, op = ctx.routing, f"{ctx.op} (backward)"
        grad_rows = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_rows = _moe._dispatch(grad_y, routing, gates, op)
        if gates is not None and ctx.needs_input_grad[1]:
            grad_gates = _moe._gate_grad(grad_y, rows, routing, _dtype_name(gates), op)
        return grad_rows, grad_gates, None, None


def fast_encode(x: torch.Tensor, routing: Routing, gates: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, M) -> dispatched (E, C, M); see a2a.fast_encode."""
    routing = _moe._padded(routing, "fast_encode")
    rows = _Dispatch.apply(x, gates, routing, "fast_encode")
    return rows.view(routing.num_experts, routing.capacity, rows.shape[1])


def fast_decode(dispatched: torch.Tensor, routing: Routing, gates: torch.Tensor | None = None) -> torch.Tensor:
    """dispatched (E, C, M) -> y (T, M); see a2a.fast_decode."""
    routing = _moe._padded(routing, "fast_decode")
    rows = _moe._dispatched_rows(dispatched, routing, "fast_decode")
    return _Combine.apply(rows, gates, routing, "fast_decode")


def permute(x: torch.Tensor, indices: Any, num_experts: int | None = None) -> tuple[torch.Tensor, Routing]:
    """(x_sorted, perm) as a2a.permute. ``indices`` may also be a dropless
    Routing from an earlier permute (then num_experts is not needed)."""
    if isinstance(indices, Routing):
        perm = indices
        if perm.capacity is not None:
            _moe._fail("permute", "the routing has a capacity (from a2a.route); permute needs a dropless one")
    else:
        if num_experts is None:
            _moe._fail("permute", "num_experts is required with indices")
        perm = _moe._permutation(indices, num_experts, "permute")
    return _Dispatch.apply(x, None, perm, "permute"), perm


def unpermute(y_sorted: torch.Tensor, perm: Routing, gates: torch.Tensor | None = None) -> torch.Tensor:
    """(N, M) -> (T, M) as a2a.unpermute."""
    perm = _moe._check_routing(perm, "unpermute")
    if perm.capacity is not None:
        _moe._fail("unpermute", "this routing has a capacity (from a2a.route); use fast_decode with it")
    return _Combine.apply(y_sorted, gates, perm, "unpermute")
