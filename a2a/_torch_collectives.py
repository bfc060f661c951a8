"""torch.autograd versions of the collectives, public in a2a.torch.

Each forward is the collective of the same name in a2a (same checks, same
output allocation, no ``out=``); each backward is the adjoint collective of
the gradient, on the same communicator:

=================================  ==============================================
forward                            backward (of the gradient)
=================================  ==============================================
all_to_all(algo)                   all_to_all(algo)
all_to_all_flex(split, concat)     all_to_all_flex(split=concat, concat=split)
all_to_all_v(send_counts)          all_to_all_v(recv_counts): the rows go back
all_gather                         reduce_scatter(sum)
reduce_scatter(sum)                all_gather
all_gather_v(counts)               reduce_scatter_v(counts, sum)
reduce_scatter_v(counts, sum)      all_gather_v(counts)
all_reduce(sum)                    all_reduce(sum)
=================================  ==============================================

The backward passes call these same autograd functions, so with
``create_graph=True`` they record too: double backward works.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _collectives as collectives
from ._arrays import records_autograd
from ._comm import Comm
from ._errors import InvalidArgumentError

__all__ = list(collectives.COLLECTIVES)


def report_invalid(comm: Any, op: str, message: str) -> None:
    """Fails `op` on every rank: this one raises InvalidArgumentError with
    `message`, the others (inside `op`, or reporting too) RemoteError."""
    if not isinstance(comm, Comm):
        raise TypeError(f"{op}: comm must be an a2a.Comm, got {type(comm).__name__}")
    comm._native.report_invalid(op, f"{op} on rank {comm.rank} of {comm.size}: {message}")
    raise InvalidArgumentError(message)  # not reached: report_invalid raises


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """The collectives take C-contiguous arrays only, and autograd may hand
    in expanded or strided gradients (``y.sum().backward()``)."""
    return grad.contiguous()


class _AllToAll(torch.autograd.Function):
    """A permutation of blocks among the ranks: its own adjoint."""

    @staticmethod
    def forward(ctx, x, comm, algo):
        ctx.comm, ctx.algo = comm, algo
        return collectives.all_to_all(x, comm=comm, algo=algo)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(_dense(grad), ctx.comm, ctx.algo), None, None


class _AllToAllFlex(torch.autograd.Function):
    """Splits split_axis, concatenates concat_axis: the adjoint splits what
    was concatenated and concatenates what was split."""

    @staticmethod
    def forward(ctx, x, comm, split_axis, concat_axis, algo):
        ctx.comm, ctx.axes, ctx.algo = comm, (split_axis, concat_axis), algo
        return collectives.all_to_all_flex(
            x, comm=comm, split_axis=split_axis, concat_axis=concat_axis, algo=algo
        )

    @staticmethod
    def backward(ctx, grad):
        split_axis, concat_axis = ctx.axes
        return (
            _AllToAllFlex.apply(_dense(grad), ctx.comm, concat_axis, split_axis, ctx.algo),
            None,
            None,
            None,
            None,
        )


class _UnevenExchange:
    """One uneven exchange and its reverse, for all_to_all_v's autograd.

    The first forward run is a2a.all_to_all_v itself (one count exchange, its
    checks and messages). Every later run, the reverse (backward) or the
    forward direction again (double backward), goes through a plan made on
    first use and kept with the graph: a backward pass repeated with
    ``retain_graph=True`` exchanges no counts.
    """

    def __init__(self, send_counts: Any, comm: Comm, algo: str):
        self.comm, self.algo = comm, algo
        self._send_counts = send_counts
        self.counts: tuple[np.ndarray, np.ndarray] | None = None  # (sent, received) per rank
        self._plans: dict[bool, collectives.VPlan] = {}

    def run(self, x: Any, reverse: bool) -> Any:
        if self.counts is None:  # the first forward run
            recv, recv_counts = collectives.all_to_all_v(x, self._send_counts, comm=self.comm, algo=self.algo)
            self.counts = (_int64(self._send_counts), recv_counts)
            self._send_counts = None
            return recv
        plan = self._plans.get(reverse)
        if plan is None:
            sends = self.counts[1] if reverse else self.counts[0]
            plan = self._plans[reverse] = collectives.plan_v(sends, like=x, comm=self.comm, algo=self.algo)
        return plan.run(x)


def _int64(counts: Any) -> np.ndarray:
    """A copy of counts that a2a.all_to_all_v accepted (a list, an array or a tensor)."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    return np.array(counts, dtype=np.int64)


class _AllToAllV(torch.autograd.Function):
    """An uneven exchange (or its reverse): the adjoint sends the received
    rows back, ``recv_counts[j]`` of them to rank j."""

    @staticmethod
    def forward(ctx, x, exchange, reverse):
        ctx.exchange, ctx.reverse = exchange, reverse
        return exchange.run(x, reverse)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAllV.apply(_dense(grad), ctx.exchange, not ctx.reverse), None, None


class _AllGather(torch.autograd.Function):
    """Stacks every rank's x: the adjoint sums every rank's gradient of the
    block that came from this rank (a reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, comm, out_box=(None,)):
        # out= travels in a tuple: as a tensor argument autograd would take it for an input.
        ctx.comm = comm
        return collectives.all_gather(x, comm=comm, out=out_box[0])

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(_dense(grad), ctx.comm), None, None


class _ReduceScatter(torch.autograd.Function):
    """Block i of the sum over ranks goes to rank i: the adjoint hands every
    rank every block's gradient (an all_gather)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return collectives.reduce_scatter(x, comm=comm, op="sum")

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(_dense(grad), ctx.comm), None


class _AllGatherV(torch.autograd.Function):
    """Stacks every rank's rows, counts[i] of rank i: the adjoint sums every
    rank's gradient of this rank's rows (a reduce_scatter_v)."""

    @staticmethod
    def forward(ctx, x, counts, comm):
        y = collectives.all_gather_v(x, counts, comm=comm)
        ctx.counts, ctx.comm = _int64(counts).tolist(), comm  # a copy: the caller may reuse its list
        return y

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatterV.apply(_dense(grad), ctx.counts, ctx.comm), None, None


class _ReduceScatterV(torch.autograd.Function):
    """Block i (counts[i] rows) of the sum over ranks goes to rank i: the
    adjoint hands every rank every block's gradient (an all_gather_v)."""

    @staticmethod
    def forward(ctx, x, counts, comm):
        y = collectives.reduce_scatter_v(x, counts, comm=comm, op="sum")
        ctx.counts, ctx.comm = _int64(counts).tolist(), comm
        return y

    @staticmethod
    def backward(ctx, grad):
        return _AllGatherV.apply(_dense(grad), ctx.counts, ctx.comm), None, None


class _AllReduce(torch.autograd.Function):
    """The sum over ranks, on every rank: its own adjoint."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return collectives.all_reduce(x, comm=comm, op="sum")

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(_dense(grad), ctx.comm), None


def all_to_all(x: torch.Tensor, *, comm: Comm, algo: str = "linear") -> torch.Tensor:
    """a2a.all_to_all with autograd: ``(size * n, ...)`` -> same shape, rank
    j's rows ``[i*n, (i+1)*n)`` at rows ``[j*n, (j+1)*n)`` of rank i.

    Backward (collective): all_to_all of the gradient with the same ``algo``.
    """
    return _AllToAll.apply(x, comm, algo)


def all_to_all_flex(
    x: torch.Tensor, *, comm: Comm, split_axis: int, concat_axis: int, algo: str = "linear"
) -> torch.Tensor:
    """a2a.all_to_all_flex with autograd: ``x.shape[split_axis]`` is split into
    ``size`` blocks, block i goes to rank i, and the received blocks are
    concatenated along ``concat_axis`` (e.g. MoE dispatch (E, C, M) ->
    (E/size, size*C, M) with split_axis=0, concat_axis=1).

    Backward (collective): all_to_all_flex of the gradient with the axes
    swapped (split_axis=concat_axis, concat_axis=split_axis) and the same
    ``algo``.
    """
    return _AllToAllFlex.apply(x, comm, split_axis, concat_axis, algo)


def all_to_all_v(
    x: torch.Tensor, send_counts: Any, *, comm: Comm, algo: str = "linear"
) -> tuple[torch.Tensor, np.ndarray]:
    """a2a.all_to_all_v with autograd: ``send_counts[i]`` consecutive rows of
    ``x`` go to rank i. Returns ``(recv, recv_counts)``: ``recv`` holds
    ``sum(recv_counts)`` rows (rank j's before rank j+1's) and ``x``'s row
    shape; ``recv_counts`` is a NumPy int64 array and carries no gradient.

    Backward (collective): the reverse exchange, which sends the gradient's
    rows back (``recv_counts[j]`` of them to rank j) with the same ``algo``.
    Its plan is made at the first backward pass (one count exchange) and kept
    with the graph, so repeated backward passes move only the data.
    """
    exchange = _UnevenExchange(send_counts, comm, algo)
    recv = _AllToAllV.apply(x, exchange, False)
    return recv, exchange.counts[1].copy()


def all_gather(x: torch.Tensor, *, comm: Comm, out: torch.Tensor | None = None) -> torch.Tensor:
    """a2a.all_gather with autograd: ``(n, ...)`` on every rank ->
    ``(size * n, ...)``, rank i's ``x`` at rows ``[i*n, (i+1)*n)``.

    Backward (collective): reduce_scatter (sum) of the gradient: rank i gets
    the sum over ranks of the gradient's rows ``[i*n, (i+1)*n)``.

    ``out=`` (as for a2a.all_gather, and not requiring grad) receives the
    result, which still records autograd: the backward reads the gradient
    only, never the output, so a training loop can gather into the same
    buffer every step (a layer's weights, say) without allocating it.
    """
    if out is not None and isinstance(out, torch.Tensor) and out.requires_grad:
        report_invalid(comm, "all_gather", "out= must not require grad (it receives the gathered rows)")
    return _AllGather.apply(x, comm, (out,))


def _differentiable(op: str, x: Any, comm: Any, reduce_op: Any) -> bool:
    """Whether the reduction is the sum (the autograd function). Another
    known op fails on every rank while recording, and runs plainly otherwise;
    an unknown one is left to the collective to report."""
    if isinstance(reduce_op, str) and reduce_op == "sum":
        return True
    if isinstance(reduce_op, str) and reduce_op in collectives.REDUCE_OPS and records_autograd(x):
        report_invalid(
            comm,
            op,
            f"op={reduce_op!r} has no gradient here (only 'sum' differentiates), and the input requires grad "
            "while grad mode is on: reduce x.detach(), or call it under torch.no_grad()",
        )
    return False


def reduce_scatter(x: torch.Tensor, *, comm: Comm, op: str = "sum") -> torch.Tensor:
    """a2a.reduce_scatter with autograd: ``(size * n, ...)`` -> ``(n, ...)``,
    rank i gets the element-wise sum over ranks of rows ``[i*n, (i+1)*n)``.

    Backward (collective): all_gather of the gradient. Only ``op="sum"``
    differentiates: "max" or "min" on a tensor that requires grad while grad
    mode is on raise InvalidArgumentError on every rank (RemoteError on the
    others); without recording they are the plain a2a.reduce_scatter.
    """
    if _differentiable("reduce_scatter", x, comm, op):
        return _ReduceScatter.apply(x, comm)
    return collectives.reduce_scatter(x, comm=comm, op=op)


def all_gather_v(x: torch.Tensor, counts: Any, *, comm: Comm) -> torch.Tensor:
    """a2a.all_gather_v with autograd: ``(counts[rank], ...)`` on every rank
    -> ``(sum(counts), ...)``, rank i's rows starting at row
    ``counts[0] + ... + counts[i-1]``; ``counts`` is the same on every rank.

    Backward (collective): reduce_scatter_v (sum) of the gradient with the
    same counts: rank i gets the sum over ranks of the gradient's rows of
    block i.
    """
    return _AllGatherV.apply(x, counts, comm)


def reduce_scatter_v(x: torch.Tensor, counts: Any, *, comm: Comm, op: str = "sum") -> torch.Tensor:
    """a2a.reduce_scatter_v with autograd: ``(sum(counts), ...)`` ->
    ``(counts[rank], ...)``, rank i gets the element-wise sum over ranks of
    its block of ``counts[i]`` rows.

    Backward (collective): all_gather_v of the gradient with the same counts.
    Only ``op="sum"`` differentiates, as for :func:`reduce_scatter`.
    """
    if _differentiable("reduce_scatter_v", x, comm, op):
        return _ReduceScatterV.apply(x, counts, comm)
    return collectives.reduce_scatter_v(x, counts, comm=comm, op=op)


def all_reduce(x: torch.Tensor, *, comm: Comm, op: str = "sum") -> torch.Tensor:
    """a2a.all_reduce with autograd: the element-wise sum over ranks, same
    shape and dtype, on every rank.

    Backward (collective): all_reduce (sum) of the gradient. Only
    ``op="sum"`` differentiates, as for :func:`reduce_scatter`.
    """
    if _differentiable("all_reduce", x, comm, op):
        return _AllReduce.apply(x, comm)
    return collectives.all_reduce(x, comm=comm, op=op)
