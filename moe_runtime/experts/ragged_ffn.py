"""The experts' FFN on rows grouped by expert (the dropless layout), with a hand-written backward.

rows (R, M), expert e's rows at [offsets[e], offsets[e + 1]) (n experts,
R = offsets[n]; an expert may have none)::

    out[rows of e] = act(rows_e @ fc1[e]^T + fc1_bias[e]) @ fc2[e] + fc2_bias[e]
    fc1, fc2 (n, H, M); fc1_bias (n, H); fc2_bias (n, M) (biases may be None)

The forward keeps rows and one (R, H) hidden tensor (relu's output or the
pre-activation, activation.py) for the backward, instead of autograd's graph
of every expert's ops; the backward writes each weight gradient once with the
layer's 1/W (`weight_grad_scale`) folded into its matmul, like the padded
flows' segment (flows.py).

Where torch's grouped GEMM takes the rows (``torch._grouped_mm``: bfloat16
or float16, and float32 on the CPU; rows of a multiple of 16 bytes, on a
device where it runs: grouped.py asks once), every matmul of the step is one grouped GEMM
over all experts, forward and backward: 2 GEMMs forward and 4 backward
whatever n, where the loop launches 2 n and 4 n (on a GPU, as many kernel
launches, most of them small). Otherwise the loop over the experts.

The offsets are host integers, or a tensor on the rows' device (a2a.permute(...,
wait=False)'s: nothing read back); a tensor takes the grouped GEMMs, and where
they do not run the call fails naming what they need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .activation import Activation, activate, activation_backward
from .grouped import GroupedRows, grouped_rows, grouped_rows_on_device

__all__ = ["ComputeClock", "ExpertWeights", "RaggedGroups", "ffn_rows", "ragged_backward", "ragged_ffn", "ragged_forward"]

# One expert's (fc1 (H, M), fc1_bias (H,) or None, fc2 (H, M), fc2_bias (M,) or None).
ExpertWeights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


@dataclass
class ComputeClock:
    """Seconds the experts' forward and backward took, by `timer` (FlexMoE's
    cost model fits its throughput on them)."""

    timer: Callable[[], float]
    seconds: float = 0.0


def _bias(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def ffn_rows(rows: torch.Tensor, offsets: Sequence[int], experts: Iterable[tuple[int, ExpertWeights]],
             activation: Activation, out: torch.Tensor, hidden: torch.Tensor) -> None:
    """out[rows of e] for every (e, weights) of `experts` (in any order; an
    expert without rows is skipped); `hidden` (R, H) receives what the
    backward needs. Experts not listed leave their rows of `out` unwritten."""
    for e, (fc1, fc1_bias, fc2, fc2_bias) in experts:
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        h = hidden[lo:hi]
        if fc1_bias is None:
            torch.mm(rows[lo:hi], fc1.t(), out=h)
        else:
            torch.addmm(fc1_bias, rows[lo:hi], fc1.t(), out=h)
        activated = activate(activation, h)
        if fc2_bias is None:
            torch.mm(activated, fc2, out=out[lo:hi])
        else:
            torch.addmm(fc2_bias, activated, fc2, out=out[lo:hi])


@dataclass(frozen=True)
class RaggedGroups:
    """How :func:`ragged_forward` ran, what :func:`ragged_backward` needs
    besides the tensors: the grouped GEMMs' groups (None: the loop over the
    experts ran) and the offsets."""

    groups: GroupedRows | None
    offsets: Sequence[int] | torch.Tensor


def ragged_forward(rows: torch.Tensor, offsets: Sequence[int] | torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
                   fc2: torch.Tensor, fc2_bias: torch.Tensor | None,
                   activation: Activation) -> tuple[torch.Tensor, torch.Tensor, RaggedGroups]:
    """(out (R, M) of every expert on its rows, the (R, H) hidden tensor the
    backward needs, how they were computed): grouped GEMMs where torch runs
    them, else expert after expert; no autograd (see ragged_backward)."""
    if isinstance(offsets, torch.Tensor) and rows.shape[0] == 0:
        offsets = [0] * (fc1.shape[0] + 1)  # no rows: every expert empty, known without reading them
    if not isinstance(offsets, torch.Tensor):
        groups = grouped_rows(rows, fc1, fc2, offsets)
    elif (groups := grouped_rows_on_device(rows, fc1, fc2, offsets)) is None:
        raise RuntimeError(
            f"the experts' rows are grouped by offsets on the device, which only torch's grouped GEMM takes, "
            f"and it does not take {tuple(rows.shape)} {rows.dtype} rows on {rows.device} with experts of "
            f"{fc1.shape[1]} units (it takes bfloat16 or float16, float32 on the CPU, rows and hidden units "
            f"of a multiple of 16 bytes)")
    if groups is not None:
        out, hidden = groups.ffn(rows, fc1, fc1_bias, fc2, fc2_bias, activation)
    else:
        hidden = rows.new_empty((rows.shape[0], fc1.shape[1]))
        out = rows.new_empty((rows.shape[0], fc2.shape[2]))
        weights = ((e, (fc1[e], _bias(fc1_bias, e), fc2[e], _bias(fc2_bias, e))) for e in range(fc1.shape[0]))
        ffn_rows(rows, offsets, weights, activation, out, hidden)
    return out, hidden, RaggedGroups(groups, offsets)


def ragged_backward(how: RaggedGroups, grad_out: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor,
                    fc1: torch.Tensor, fc2: torch.Tensor, activation: Activation, scale: float,
                    with_bias: tuple[bool, bool]) -> GroupedRows.Gradients:
    """(grad rows, grad fc1, grad fc1_bias, grad fc2, grad fc2_bias) of
    ragged_forward (the bias gradients None where `with_bias` says there is
    none), the weight gradients times `scale`."""
    if how.groups is not None:
        return how.groups.ffn_backward(grad_out, rows, hidden, fc1, fc2, activation, scale, with_bias)
    return _loop_backward(grad_out, rows, hidden, fc1, fc2, how.offsets, activation, scale, with_bias)


class _RaggedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, fc1, fc1_bias, fc2, fc2_bias, offsets, activation, scale, clock):
        start = None if clock is None else clock.timer()
        out, hidden, how = ragged_forward(rows, offsets, fc1, fc1_bias, fc2, fc2_bias, activation)
        ctx.save_for_backward(rows, hidden, fc1, fc2)
        ctx.how, ctx.activation, ctx.scale, ctx.clock = how, activation, scale, clock
        ctx.with_bias = (fc1_bias is not None, fc2_bias is not None)
        if clock is not None:
            clock.seconds += clock.timer() - start
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        clock = ctx.clock
        start = None if clock is None else clock.timer()
        rows, hidden, fc1, fc2 = ctx.saved_tensors
        grads = ragged_backward(ctx.how, grad_out.contiguous(), rows, hidden, fc1, fc2, ctx.activation, ctx.scale,
                                ctx.with_bias)
        if clock is not None:
            clock.seconds += clock.timer() - start
        return (*grads, None, None, None, None)


def _loop_backward(grad_out: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, fc1: torch.Tensor,
                   fc2: torch.Tensor, offsets: Sequence[int], activation: Activation, scale: float,
                   with_bias: tuple[bool, bool]) -> GroupedRows.Gradients:
    """(grad rows, grad fc1, grad fc1_bias, grad fc2, grad fc2_bias), expert after expert."""
    grad_rows = torch.empty_like(rows)
    grad_fc1, grad_fc2 = torch.zeros_like(fc1), torch.zeros_like(fc2)  # experts without rows get 0
    grad_fc1_bias = fc1.new_zeros(fc1.shape[:2]) if with_bias[0] else None
    grad_fc2_bias = fc2.new_zeros((fc2.shape[0], fc2.shape[2])) if with_bias[1] else None
    for e in range(fc1.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        grad = grad_out[lo:hi]
        activated, grad_pre = activation_backward(activation, hidden[lo:hi], grad @ fc2[e].t())
        grad_fc2[e].addmm_(activated.t(), grad, beta=0, alpha=scale)
        grad_fc1[e].addmm_(grad_pre.t(), rows[lo:hi], beta=0, alpha=scale)
        if grad_fc1_bias is not None:
            torch.sum(grad_pre, dim=0, out=grad_fc1_bias[e]).mul_(scale)
        if grad_fc2_bias is not None:
            torch.sum(grad, dim=0, out=grad_fc2_bias[e]).mul_(scale)
        torch.mm(grad_pre, fc1[e], out=grad_rows[lo:hi])
    return grad_rows, grad_fc1, grad_fc1_bias, grad_fc2, grad_fc2_bias


def ragged_ffn(rows: torch.Tensor, offsets: Sequence[int] | torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
               fc2: torch.Tensor, fc2_bias: torch.Tensor | None, activation: Activation,
               weight_grad_scale: float = 1.0, clock: ComputeClock | None = None) -> torch.Tensor:
    """out (R, M) of every local expert on its rows (see the module docstring);
    differentiable. `clock` adds the forward's and the backward's seconds."""
    offsets = offsets if isinstance(offsets, torch.Tensor) else list(offsets)
    return _RaggedFFN.apply(rows, fc1, fc1_bias, fc2, fc2_bias, offsets, activation, weight_grad_scale, clock)
