"""The segment of the expert flow: the dispatch buffer to the combine buffer,
exchange -> experts -> exchange, forward and backward, in d chunks.

Input: the dispatch buffer (d, E, Cd, M) of this rank's tokens, chunk-major
(chunk i holds capacity rows [i*Cd, (i+1)*Cd) of every expert, contiguous).
Output: the combine buffer of the same shape, every row the expert's output
for the row's token, plus the fc2 bias. flows/expert.py draws the exchanges
of each r; its one autograd node (flows/expert_node.py) runs the segment
between the encode and the decode. The backward runs the adjoint flow in the
same chunks (repeat <-> sum, each exchange <-> its reverse), so forward and
backward both overlap, and the buffers come from the layer's pool (no
per-step allocation of the big tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import a2a

from ..common.buffers import Lease
from ..common.overlap import Overlap
from ..common.precision import FP8_BLOCK
from ..experts.activation import activate, activation_backward
from .base import Plan

__all__ = ["Segment", "Shape"]


@dataclass(frozen=True)
class Shape:
    """The sizes of a segment."""

    experts: int  # E
    model_dim: int  # M
    local_experts: int  # n_l: experts this rank computes
    hidden: int  # Hl: hidden units this rank computes per expert
    repeat: int  # r (1 for r = 0)
    group: int  # g
    chunks: int  # d
    chunk_rows: int  # Cd
    world: int  # W; 0 for r = 0 and for one rank, which exchange nothing

    @property
    def exchanged(self) -> bool:
        """Whether the rows travel to the experts (r >= 1) or stay (r = 0)."""
        return self.world > 0

    @property
    def blocks(self) -> int:
        """X = E*r*g send blocks per chunk."""
        return self.experts * self.repeat * self.group

    @property
    def rows(self) -> int:
        """Rows each local expert computes per chunk."""
        if not self.exchanged:  # r = 0: the local capacity
            return self.chunk_rows
        return self.world * self.chunk_rows // self.group


class Segment:
    """One call's exchange -> expert -> exchange, forward and backward."""

    def __init__(self, shape: Shape, plan: Plan, comm: a2a.Comm | None, overlap: Overlap, lease: Lease,
                 activation, weight_grad_scale: float = 1.0, *, pooled_weight_grads: bool = False,
                 fp8: str | None = None):
        self.shape, self.plan, self.comm, self.overlap, self.lease = shape, plan, comm, overlap, lease
        # FP8 dispatch (fp8: a2a's format): the forward's rows arrive as packed
        # FP8 rows and are dequantized at the experts; everything else, the
        # backward included, moves the rows' own dtype.
        self.fp8 = fp8
        # A function, not a bound method: a Segment holding its own method
        # would be a cycle, freed only by the garbage collector, and keep its
        # lease (the pooled buffers) alive into the next step.
        self.dispatch_chunk = Segment._to_experts if fp8 is None else Segment._fp8_to_experts
        self.activation = activation
        # Every expert weight's gradient is made here, so the layer's 1/W
        # ("mean") is folded into its matmuls rather than applied afterwards.
        self.scale = weight_grad_scale
        # True when the weights were gathered: their gradients feed the
        # gather's backward only, so they may live in the lease's buffers.
        # Never for a rank's own parameters: autograd keeps those gradients
        # as .grad, and a pooled buffer would be overwritten by the next step.
        self.pooled_weight_grads = pooled_weight_grads
        self.inputs: list[torch.Tensor] = []  # expert input rows of every chunk (kept for the weight gradients)
        self.hidden: list[torch.Tensor] = []  # relu(h) for relu, else the pre-activation

    # The two exchanges of a chunk, written once: `forward` moves token rows
    # to the experts (repeat, then exchange), `backward` brings them back
    # (exchange, then sum over the r copies). The backward flow uses the same
    # two, swapped.
    def _to_experts(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        sh = self.shape
        if sh.repeat > 1:
            repeated = self.lease.get("repeat", (sh.experts, sh.repeat, sh.chunk_rows, sh.model_dim), rows.dtype,
                                      rows.device)
            repeated.copy_(rows.unsqueeze(1).expand_as(repeated))
            rows = repeated
        send = rows.view(sh.blocks, sh.chunk_rows // sh.group, sh.model_dim)
        a2a.all_to_all_flex(send, comm=self.comm, split_axis=0, concat_axis=1, algo=self.plan.algo, out=out)

    def _fp8_to_experts(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """_to_experts of packed FP8 rows (E, Cd, row bytes): the same blocks
        exchanged as bytes (codes and scales together), dequantized into out."""
        sh = self.shape
        width = packed.shape[-1]
        if sh.repeat > 1:
            repeated = self.lease.get("repeat_fp8", (sh.experts, sh.repeat, sh.chunk_rows, width), torch.uint8,
                                      packed.device)
            repeated.copy_(packed.unsqueeze(1).expand_as(repeated))
            packed = repeated
        send = packed.view(sh.blocks, sh.chunk_rows // sh.group, width)
        arrived = self.lease.get("arrived_fp8", (sh.local_experts, sh.rows, width), torch.uint8, packed.device)
        a2a.all_to_all_flex(send, comm=self.comm, split_axis=0, concat_axis=1, algo=self.plan.algo, out=arrived)
        q, scales = a2a.unpack_fp8(arrived, sh.model_dim, block=FP8_BLOCK, format=self.fp8)
        a2a.dequantize_fp8(q, scales, block=FP8_BLOCK, dtype=str(out.dtype).removeprefix("torch."), out=out)

    def _from_experts(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        sh = self.shape
        if sh.repeat == 1:
            a2a.all_to_all_flex(rows, comm=self.comm, split_axis=1, concat_axis=0, algo=self.plan.algo,
                                out=out.view(sh.blocks, sh.chunk_rows // sh.group, sh.model_dim))
            return
        back = self.lease.get("back", (sh.experts, sh.repeat, sh.chunk_rows, sh.model_dim), rows.dtype, rows.device)
        a2a.all_to_all_flex(rows, comm=self.comm, split_axis=1, concat_axis=0, algo=self.plan.algo,
                            out=back.view(sh.blocks, sh.chunk_rows // sh.group, sh.model_dim))
        torch.sum(back, dim=1, out=out)

    def forward(self, dispatched: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
                fc2: torch.Tensor, fc2_bias: torch.Tensor | None) -> torch.Tensor:
        sh, lease = self.shape, self.lease
        dtype, device = fc1.dtype, dispatched.device  # the rows' dtype (run_expert_node cast the weights to it)
        # The last axis: M, or the bytes of a packed FP8 row.
        chunks = dispatched.view(sh.chunks, sh.experts, sh.chunk_rows, dispatched.shape[-1])
        combined = lease.get("combine", (sh.chunks, sh.experts, sh.chunk_rows, sh.model_dim), dtype, device)
        exchanged = sh.exchanged
        local = (sh.local_experts, sh.rows, sh.model_dim)
        received = lease.get("received", (sh.chunks, *local), dtype, device) if exchanged else chunks
        outputs = lease.get("expert_out", (sh.chunks, *local), dtype, device) if exchanged else combined
        hidden = lease.get("hidden", (sh.chunks, sh.local_experts, sh.rows, sh.hidden), dtype, device)
        # Each chunk's views, by one op per buffer (indexing would be one per chunk).
        self.inputs, self.hidden, chunk_outputs = list(received.unbind(0)), list(hidden.unbind(0)), outputs.unbind(0)

        def before(i: int) -> None:
            if exchanged:
                self.dispatch_chunk(self, chunks[i], received[i])

        # The fc2 bias goes where each row's output is whole: at the expert
        # (r <= 1), else once, after the sum over the r partial outputs.
        at_experts = sh.repeat == 1

        def compute(i: int) -> None:
            self._ffn_forward(self.inputs[i], fc1, fc1_bias, fc2, self.hidden[i], chunk_outputs[i])
            if fc2_bias is not None and at_experts:
                chunk_outputs[i].add_(fc2_bias.unsqueeze(1))

        def after(i: int) -> None:
            if exchanged:
                self._from_experts(outputs[i], combined[i])
            if fc2_bias is not None and not at_experts:
                combined[i].add_(fc2_bias.unsqueeze(1))

        self.overlap.run(sh.chunks, before, compute, after)
        return combined.view(sh.chunks * sh.experts, sh.chunk_rows, sh.model_dim)

    def backward(self, grad_combined: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
                 fc2: torch.Tensor, with_fc2_bias: bool):
        sh, lease = self.shape, self.lease
        dtype, device = grad_combined.dtype, grad_combined.device
        grads = grad_combined.view(sh.chunks, sh.experts, sh.chunk_rows, sh.model_dim)
        exchanged = sh.exchanged
        local = (sh.local_experts, sh.rows, sh.model_dim)
        # The forward's expert outputs are dead: their buffer takes the output gradients.
        grad_outputs = lease.get("expert_out", (sh.chunks, *local), dtype, device) if exchanged else grads
        grad_dispatched = lease.get("grad_dispatch", grads.shape, dtype, device)
        # Chunk 0 writes the weight gradients (beta = 0 ignores their contents), later chunks add.
        grad_fc1, grad_fc2 = self._weight_grad("grad_fc1", fc1), self._weight_grad("grad_fc2", fc2)
        grad_fc1_bias = None if fc1_bias is None else self._weight_grad("grad_fc1_bias", fc1_bias)
        # Chunk i's input rows are dead once its weight gradient is summed: the
        # input gradient takes their place.
        grad_inputs = lease.get("received", (sh.chunks, *local), dtype, device) if exchanged else grad_dispatched

        def before(i: int) -> None:
            if exchanged:
                self._to_experts(grads[i], grad_outputs[i])

        at_experts = sh.repeat == 1
        grad_fc2_bias = None
        if with_fc2_bias:
            grad_fc2_bias = (torch.zeros(sh.local_experts, sh.model_dim, dtype=dtype, device=device) if at_experts
                             else grads.sum(dim=(0, 2)).mul_(self.scale))

        def compute(i: int) -> None:
            if grad_fc2_bias is not None and at_experts:
                grad_fc2_bias.add_(grad_outputs[i].sum(dim=1), alpha=self.scale)
            self._ffn_backward(i, grad_outputs[i], fc1, fc2, grad_fc1, grad_fc1_bias, grad_fc2, grad_inputs[i])

        def after(i: int) -> None:
            if exchanged:
                self._from_experts(grad_inputs[i], grad_dispatched[i])

        self.overlap.run(sh.chunks, before, compute, after)
        self.inputs, self.hidden = [], []
        return grad_dispatched.view(grad_combined.shape), grad_fc1, grad_fc1_bias, grad_fc2, grad_fc2_bias

    def _weight_grad(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """A buffer of `weight`'s shape for its gradient (contents undefined)."""
        if self.pooled_weight_grads:
            return self.lease.get(name, weight.shape, weight.dtype, weight.device)
        return torch.empty_like(weight)

    def _ffn_forward(self, x, fc1, fc1_bias, fc2, hidden, out) -> None:
        """out = act(x @ fc1^T + b1) @ fc2, per local expert; `hidden` keeps
        relu's output, or the pre-activation of any other function."""
        if fc1_bias is None:
            torch.bmm(x, fc1.transpose(1, 2), out=hidden)
        else:
            torch.baddbmm(fc1_bias.unsqueeze(1), x, fc1.transpose(1, 2), out=hidden)
        torch.bmm(activate(self.activation, hidden), fc2, out=out)

    def _ffn_backward(self, i, grad_out, fc1, fc2, grad_fc1, grad_fc1_bias, grad_fc2, grad_x) -> None:
        x, hidden = self.inputs[i], self.hidden[i]
        sh = self.shape
        grad_hidden = self.lease.get("grad_hidden", (sh.local_experts, sh.rows, sh.hidden), grad_out.dtype,
                                     grad_out.device)
        beta, alpha = (0 if i == 0 else 1), self.scale  # chunk 0 writes, the others add
        torch.bmm(grad_out, fc2.transpose(1, 2), out=grad_hidden)
        activated, grad_pre = activation_backward(self.activation, hidden, grad_hidden)
        grad_fc2.baddbmm_(activated.transpose(1, 2), grad_out, beta=beta, alpha=alpha)
        if grad_pre is not grad_hidden:
            grad_hidden.copy_(grad_pre)
        grad_fc1.baddbmm_(grad_hidden.transpose(1, 2), x, beta=beta, alpha=alpha)
        if grad_fc1_bias is not None:
            if i == 0:
                torch.sum(grad_hidden, dim=1, out=grad_fc1_bias).mul_(alpha)
            else:
                grad_fc1_bias.add_(grad_hidden.sum(dim=1), alpha=alpha)
        torch.bmm(grad_hidden, fc1, out=grad_x)
