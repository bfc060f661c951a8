"""The per-expert capacity flow (``MoELayer(flow="dynamic")`` or
``flow=DynamicCapacity(...)``), as a :class:`moe_runtime.flows.base.Flow`.

Each call, every rank's demand per expert and token count are agreed (their
maximum over ranks), the policy of moe_runtime.dynamic.capacity turns them
into one capacity per expert, and moe_runtime.dynamic.ragged runs the
ragged flow with them: r = 1, d = 1, whole experts on every rank.
``layer.capacity_tracker`` holds the policy's state.

A recomputation of a call (activation checkpointing: moe_runtime.common.recompute)
runs at the capacities its forward had, kept under the agreed counts and a
checksum of the routing, and leaves the policy's state as it is.
"""

from __future__ import annotations

import numpy as np
import torch

from ..common.host_values import all_reduce_values
from ..common.recompute import KeptDecisions, recomputing
from ..flows.base import Call, Plan, WholeExpertFlow
from .capacity import CapacityTracker, DynamicCapacity
from .ragged import ragged_moe

__all__ = ["DynamicFlow"]


class DynamicFlow(WholeExpertFlow):
    """One capacity per expert, picked each call by the policy."""

    name = "dynamic"
    why_refused = "its capacities come from its policy"

    def __init__(self, context, settings: DynamicCapacity | None = None):
        super().__init__(context, settings or DynamicCapacity())
        if not isinstance(self.settings, DynamicCapacity):
            raise TypeError(f"dynamic capacity settings must be a moe_runtime.DynamicCapacity, got "
                            f"{type(self.settings).__name__}")
        self.tracker = CapacityTracker(self.settings, context.num_experts)
        self.kept: KeptDecisions[np.ndarray] = KeptDecisions()

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        context, decision = self.context, call.decision
        indices = decision.indices.contiguous()
        num_experts = context.num_experts
        # Each expert's count, a checksum of the routing and the token count, the maximum over ranks: the
        # policy's input, and the key under which a recomputation of this call finds its capacities.
        chosen = indices.reshape(-1)
        counts = torch.bincount(chosen[chosen >= 0], minlength=num_experts)
        checksum = routing_checksum(chosen).reshape(1)
        mine = np.append(torch.cat([counts, checksum]).cpu().numpy(), indices.shape[0]).astype(np.int64)
        agreed = all_reduce_values(mine, context.comm, op="max")
        demand, num_tokens, k = agreed[:num_experts], int(agreed[-1]), indices.shape[1]
        key = (tuple(agreed.tolist()), k)
        if recomputing():
            capacities = self.kept.take(key)
            if capacities is None:  # its forward was not kept: the policy's answer, which moves nothing
                capacities = self.tracker.peek(demand, num_tokens, k)
        else:
            capacities = self.tracker.update(demand, num_tokens, k)
            self.kept.keep(key, capacities)
        prioritized = context.batch_prioritized_routing
        scores = decision.scores.detach().contiguous() if prioritized else None
        algo = call.choice.algo
        weights = self.whole_expert_weights(call.tokens.dtype)
        y, routing, sent = ragged_moe(call.tokens, indices, decision.gates, capacities=capacities,
                                      weights=weights, activation=context.experts.activation_fn,
                                      comm=context.exchange_comm, algo=algo, is_postscore=context.is_postscore,
                                      scores=scores, weight_grad_scale=context.weight_grad_scale)
        most = int(capacities.max())
        return y, Plan(1, 1, algo, most, most, routing.num_dropped, sent,
                       capacities=tuple(routing.capacity.tolist()), flow=self.name)


def routing_checksum(chosen: torch.Tensor) -> torch.Tensor:
    """() int64: sum of (expert + 1) times a weight of the choice's position, so
    that routings with equal counts almost always differ in it."""
    positions = torch.arange(chosen.numel(), dtype=torch.int64, device=chosen.device)
    return ((chosen.to(torch.int64) + 1) * (positions * 40503 % 65521 + 1)).sum()
