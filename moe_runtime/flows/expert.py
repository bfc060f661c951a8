"""Tutel's flow: routing, encode, the segment of (r, d, algorithm), decode.

The segment (flows/segment.py) takes the dispatch buffer (d, E, Cd, M) of
this rank's tokens, chunk-major (chunk i holds capacity rows [i*Cd, (i+1)*Cd)
of every expert, contiguous), to the combine buffer of the same shape, every
row the expert's output for the row's token, plus the fc2 bias.
docs/runtime.md draws each step.

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

Encode, segment and decode are one autograd node (flows/expert_node.py),
whose backward runs the adjoint flow in the same chunks (repeat <-> sum,
each exchange <-> its reverse), so forward and backward both overlap, and
the buffers come from the layer's pool (no per-step allocation of the big
tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import a2a

from ..common.overlap import check_thread_level
from ..gating.capacity import buffer_capacity, local_capacity
from ..gating.gates import GateDecision
from ..tuning.dictionary import Config
from .base import Call, Choice, Context, Flow, Plan, Request
from .expert_node import ExpertNode, run_expert_node
from .segment import Segment, Shape

__all__ = ["ExpertFlow", "chunk_major"]


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
        gathered_over = comm if r == 0 else self.groups.get(group)
        fc1, fc1_bias, fc2, fc2_bias = experts.gathered(gathered_over, lease=lease)
        # FP8 dispatch when the rows travel (r >= 1; r = 0 exchanges nothing).
        fp8 = context.dispatch_format if r >= 1 else None
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
        node = ExpertNode(segment, layout, context.is_postscore)
        return run_expert_node(node, tokens, decision.gates, fc1, fc1_bias, fc2, fc2_bias), plan
