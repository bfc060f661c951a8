"""The parallel flows between the dispatch buffer and the combine buffer.

Input: the dispatch buffer (d, E, Cd, M) of this rank's tokens, chunk-major
(chunk i holds capacity rows [i*Cd, (i+1)*Cd) of every expert, contiguous).
Output: the combine buffer of the same shape, every row the expert's output
for the row's token, plus the fc2 bias. docs/runtime.md draws each step.

r = 0 (DP, Tutel Figure 6): the experts were all-gathered whole; every expert
runs on the local rows. No exchange (d is 1).

r >= 1 (EP+DP+MP, Tutel Figure 7), s = ranks per expert (1 when E >= W),
g = s / r ranks per group (they share a gathered H/r slice), per chunk::

    (E, Cd, M) --repeat r--> (E, r, Cd, M) = (X, Cd/g, M)       X = E*r*g blocks
        block e*r*g + q*g + m: rows [m*Cd/g, (m+1)*Cd/g) of expert e, for the
        ranks of group q of expert e (rank e*s + q*g + m); X = W when s > 1
    --all_to_all_flex(split 0, concat 1)--> (n_l, W*Cd/g, M)     expert's rows
    --FFN over the H/r slice-->              (n_l, W*Cd/g, M)     partial sums
    --all_to_all_flex(split 1, concat 0)--> (E, r, Cd, M) --sum over r--> (E, Cd, M)

r = 1, s = 1 is plain expert parallelism: no repeat, no gather, no sum.

The whole segment is one autograd Function whose backward runs the adjoint
flow in the same chunks (repeat <-> sum, each exchange <-> its reverse), so
forward and backward both overlap, and its buffers come from the layer's
pool (no per-step allocation of the big tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from ..common.buffers import Lease
from ..common.overlap import Overlap, check_thread_level
from ..common.precision import FP8_BLOCK
from ..experts.activation import activate, activation_backward
from ..gating.capacity import buffer_capacity, local_capacity
from ..gating.gates import GateDecision
from ..tuning.dictionary import Config
from .base import Call, Choice, Context, Flow, Plan, Request

__all__ = ["ExpertFlow", "Segment", "chunk_major", "run_segment"]

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


def chunk_major(routing: a2a.Routing, indices: torch.Tensor, num_experts: int, chunks: int, chunk_rows: int,
                scores: torch.Tensor | None) -> a2a.Routing:
    """The same slots, laid out chunk-major: slot `loc` of expert e becomes
    slot loc % Cd of virtual expert (loc // Cd) * E + e, so that chunk i is the
    contiguous (E, Cd, M) block i of the buffer. Routing again in the same
    token order (the same priority for Batch Prioritized Routing) keeps every
    slot's position inside its chunk."""
    locations = routing.locations
    kept = (indices >= 0) & (locations < routing.capacity)
    virtual = torch.where(kept, (locations // chunk_rows) * num_experts + indices, torch.full_like(indices, -1))
    prioritized = scores is not None
    return a2a.route(virtual.contiguous(), chunks * num_experts, capacity=chunk_rows, scores=scores,
                     batch_prioritized=prioritized, wait=False)


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
        dtype, device = fc1.dtype, dispatched.device  # the rows' dtype (run_segment cast the weights to it)
        # The last axis: M, or the bytes of a packed FP8 row.
        chunks = dispatched.view(sh.chunks, sh.experts, sh.chunk_rows, dispatched.shape[-1])
        combined = lease.get("combine", (sh.chunks, sh.experts, sh.chunk_rows, sh.model_dim), dtype, device)
        exchanged = sh.exchanged
        local = (sh.local_experts, sh.rows, sh.model_dim)
        received = lease.get("received", (sh.chunks, *local), dtype, device) if exchanged else chunks
        outputs = lease.get("expert_out", (sh.chunks, *local), dtype, device) if exchanged else combined
        hidden = lease.get("hidden", (sh.chunks, sh.local_experts, sh.rows, sh.hidden), dtype, device)
        self.inputs = [received[i] for i in range(sh.chunks)]
        self.hidden = [hidden[i] for i in range(sh.chunks)]

        def before(i: int) -> None:
            if exchanged:
                self.dispatch_chunk(self, chunks[i], received[i])

        # The fc2 bias goes where each row's output is whole: at the expert
        # (r <= 1), else once, after the sum over the r partial outputs.
        at_experts = sh.repeat == 1

        def compute(i: int) -> None:
            self._ffn_forward(received[i], fc1, fc1_bias, fc2, hidden[i], outputs[i])
            if fc2_bias is not None and at_experts:
                outputs[i].add_(fc2_bias.unsqueeze(1))

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


class _SegmentFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatched, fc1, fc1_bias, fc2, fc2_bias, segment):
        ctx.segment = segment
        ctx.with_fc2_bias = fc2_bias is not None
        ctx.save_for_backward(fc1, fc1_bias, fc2)
        return segment.forward(dispatched, fc1, fc1_bias, fc2, fc2_bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_combined):
        fc1, fc1_bias, fc2 = ctx.saved_tensors
        grads = ctx.segment.backward(grad_combined.contiguous(), fc1, fc1_bias, fc2, ctx.with_fc2_bias)
        return (*grads, None)


class _Fp8SegmentFunction(torch.autograd.Function):
    """The segment fed with FP8 rows: the tokens quantized once and encoded
    as packed FP8 rows (a2a.quantize_fp8, a2a.fast_encode of the pair); the
    backward is the segment's in the tokens' dtype, then the encode's
    adjoint (the sum of each token's kept rows: fast_decode without gates).
    The quantization passes the gradient straight through."""

    @staticmethod
    def forward(ctx, tokens, fc1, fc1_bias, fc2, fc2_bias, segment, layout):
        ctx.segment, ctx.layout = segment, layout
        ctx.with_fc2_bias = fc2_bias is not None
        ctx.save_for_backward(fc1, fc1_bias, fc2)
        pair = a2a.quantize_fp8(tokens.detach(), FP8_BLOCK, format=segment.fp8)
        packed = a2a.pack_fp8(*a2a.fast_encode(pair, layout))
        return segment.forward(packed, fc1, fc1_bias, fc2, fc2_bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_combined):
        fc1, fc1_bias, fc2 = ctx.saved_tensors
        grad_dispatched, *weight_grads = ctx.segment.backward(grad_combined.contiguous(), fc1, fc1_bias, fc2,
                                                              ctx.with_fc2_bias)
        grad_tokens = a2a.fast_decode(grad_dispatched.view(dispatched_shape(ctx.layout, grad_dispatched)),
                                      ctx.layout)
        return (grad_tokens, *weight_grads, None, None)


def dispatched_shape(layout: a2a.Routing, rows: torch.Tensor) -> tuple[int, ...]:
    """The dispatch buffer's shape as fast_decode takes it: (E', C', M)."""
    return (layout.num_experts, layout.capacity, rows.shape[-1])


def run_segment(segment: Segment, dispatched: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
                fc2: torch.Tensor, fc2_bias: torch.Tensor | None, *, layout: a2a.Routing | None = None) -> torch.Tensor:
    """The combine buffer of `dispatched` (autograd when anything requires grad).
    Under autocast the rows come in its dtype and the weights stay in theirs:
    they are cast to the rows' dtype, as autocast casts a matmul's operands.
    With an FP8 segment, `dispatched` is the tokens (T, M) and `layout` the
    routing that encodes them (_Fp8SegmentFunction)."""
    fc1, fc1_bias, fc2, fc2_bias = (None if w is None else w.to(dispatched.dtype)
                                    for w in (fc1, fc1_bias, fc2, fc2_bias))
    if segment.fp8 is not None:
        return _Fp8SegmentFunction.apply(dispatched, fc1, fc1_bias, fc2, fc2_bias, segment, layout)
    return _SegmentFunction.apply(dispatched, fc1, fc1_bias, fc2, fc2_bias, segment)


def divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def parse_parallel_type(parallel_type: str, sharers: int) -> int | None:
    """The default r of Tutel's parallel_type; None for the dictionary."""
    if parallel_type in ("auto", "adaptive:auto"):
        return None
    if parallel_type == "data":
        return 0
    if parallel_type == "model":
        return sharers
    if isinstance(parallel_type, str) and parallel_type.startswith("adaptive:"):
        try:
            return int(parallel_type.split(":", 1)[1])
        except ValueError:
            pass
    raise ValueError(
        f"parallel_type must be 'adaptive:<r>', 'adaptive:auto', 'auto', 'data' or 'model', got {parallel_type!r}"
    )


def positive_degree(d: Any) -> int:
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
        raise ValueError(f"a2a_ffn_overlap_degree must be a positive integer, got {d!r}")
    return int(d)


class ExpertFlow(Flow):
    """Tutel's flow (the module docstring): routing with the agreed capacity,
    fast_encode into the chunk-major dispatch buffer, the segment of (r, d,
    algorithm), fast_decode. ``settings``: (parallel_type, a2a_ffn_overlap_degree)."""

    name = "expert"
    takes = frozenset({"adaptive_r", "a2a_ffn_overlap_degree", "algo", "capacity_factor"})
    uses_capacity = True
    fp8_dispatch = True

    def __init__(self, context: Context, settings: tuple[str, int]):
        super().__init__(context, settings)
        parallel_type, degree = settings
        comm, experts = context.comm, context.experts
        self.sharded_count = experts.sharers
        self.valid_rs = [0, *divisors(self.sharded_count)]
        self.degree = positive_degree(degree)
        default = parse_parallel_type(parallel_type, self.sharded_count)  # None: the dictionary's
        self.adaptive_r = None if default is None else self.valid_r(default, "parallel_type")
        # One communicator per group size g > 1 that some r needs, made once (Comm.split is collective).
        sizes = sorted({self.sharded_count // r for r in self.valid_rs if r >= 1} - {1})
        self.groups = {g: comm.split(comm.rank // g, comm.rank) for g in sizes}

    def valid_r(self, r: Any, what: str) -> int:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0:
            raise ValueError(f"{what}: r must be a non-negative integer, got {r!r}")
        r = min(int(r), self.sharded_count)  # Tutel: r above s means s
        if r not in self.valid_rs:
            raise ValueError(f"{what}: r = {r} is not valid for this layer; valid_rs = {self.valid_rs}")
        return r

    def local_capacity(self, decision: GateDecision, factor: float, rule: str, dropless: str) -> int:
        return local_capacity(rule, factor, decision.indices, self.context.num_experts, dropless)

    def configure(self, request: Request, chosen: Config | None) -> Choice:
        """The call's arguments, else the dictionary's choice, else the layer's defaults."""
        r, d, algo = request.r, request.d, request.algo
        if chosen is not None:
            r = chosen.r if r is None else r
            d = chosen.d if d is None else d
            algo = chosen.algo if algo is None else algo
        default_r = 1 if self.adaptive_r is None else self.adaptive_r  # None: the dictionary chose another flow
        r = self.valid_r(default_r if r is None else r, "adaptive_r")
        d = self.degree if d is None else d
        algo = self.context.default_algo if algo is None else algo
        if r == 0:
            d, algo = 1, "linear"  # no exchange to split or to route
        return Choice(Config(r, d, algo), algo)

    def keeps_agreement(self, choice: Choice) -> bool:
        # r = 0 exchanges nothing; sharded experts are gathered (or their bias
        # summed) first, on other communicators. With d > 1 the first chunk's
        # exchange comes first (on the CPU on a thread that starts no other
        # once one failed: common/overlap.py).
        return choice.config.r == 1 and self.sharded_count == 1

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        """Routing, encode, the segment of (r, d, algo), decode."""
        context, config = self.context, call.choice.config
        r, d, algo, capacity = config.r, config.d, call.choice.algo, call.capacity
        experts, num_experts, model_dim, comm = context.experts, context.num_experts, context.model_dim, context.comm
        tokens, decision = call.tokens, call.decision
        indices = decision.indices.contiguous()
        prioritized = context.batch_prioritized_routing
        scores = decision.scores.detach().contiguous() if prioritized else None
        # The capacity is agreed: nothing comes back to the host (the indices are a top-k's, in range).
        routing = a2a.route(indices, num_experts, capacity=capacity, scores=scores, batch_prioritized=prioritized,
                            wait=False)
        group = self.sharded_count // r if r >= 1 else 1
        rows = buffer_capacity(capacity, d * group)
        chunk_rows = rows // d
        layout = routing
        if rows != capacity or d > 1:
            layout = chunk_major(routing, indices, num_experts, d, chunk_rows, scores)
        # Each exchange sends E r C_b rows in all (blocks of the repeat r), 1/W of them to this rank itself.
        sent = 0 if r == 0 else num_experts * r * rows * (comm.size - 1) // comm.size
        plan = Plan(r, d, algo, capacity, rows, routing, sent)

        lease = context.pool.lease()
        gates = decision.gates
        # FP8 dispatch when the rows travel (r >= 1; r = 0 exchanges nothing):
        # the segment encodes the tokens itself (run_segment).
        fp8 = context.dispatch_format if r >= 1 else None
        if fp8 is None:
            buffer = lease.get("dispatch", (d * num_experts, chunk_rows, model_dim), tokens.dtype, tokens.device)
            dispatched = a2a_torch.fast_encode(tokens, layout, None if context.is_postscore else gates, out=buffer)
        else:
            dispatched = tokens
        gathered_over = comm if r == 0 else self.groups.get(group)
        fc1, fc1_bias, fc2, fc2_bias = experts.gathered(gathered_over, lease=lease)
        if r == 0:
            shape = Shape(num_experts, model_dim, num_experts, experts.hidden_size, 1, 1, 1, rows, 0)
        else:
            if r > 1:  # partial outputs: the whole bias is added once, at the tokens' rank
                fc2_bias = experts.fc2_bias(comm)
            # One rank exchanges with itself only: its dispatched buffer is the experts' input, as at r = 0
            # (FP8 rows still go through their exchange, which dequantizes them).
            world = comm.size if comm.size > 1 or fp8 is not None else 0
            shape = Shape(num_experts, model_dim, experts.num_local, experts.hidden_size // r, r, group, d,
                          chunk_rows, world)
        if d > 1:
            check_thread_level(context.exchange_comm)
        # Weights gathered from other ranks get their gradients in pooled buffers
        # (the gather's backward reduce-scatters them into fresh shard gradients);
        # a rank's own parameters get fresh ones, which autograd keeps as .grad.
        gathered = gathered_over is not None and gathered_over.size > 1
        segment = Segment(shape, plan, context.exchange_comm, context.overlap, lease, experts.activation_fn,
                          context.weight_grad_scale, pooled_weight_grads=gathered, fp8=fp8)
        combined = run_segment(segment, dispatched, fc1, fc1_bias, fc2, fc2_bias, layout=layout)
        # The combine buffer's gradient, as big as the buffer, is pooled too.
        grad_buffer = None
        if combined.requires_grad:
            grad_buffer = lease.get("grad_combine", combined.shape, combined.dtype, combined.device)
        y = a2a_torch.fast_decode(combined, layout, gates if context.is_postscore else None, grad_buffer=grad_buffer)
        return y, plan
