"""The per-expert capacity flow (``MoELayer(flow="dynamic")`` or
``flow=DynamicCapacity(...)``), as a :class:`moe_runtime.flows.base.Flow`.

Each call, every rank's demand per expert and token count are agreed (their
maximum over ranks), the policy of moe_runtime.dynamic.capacity turns them
into one capacity per expert, and moe_runtime.dynamic.ragged runs the
ragged flow with them: r = 1, d = 1, whole experts on every rank.
``layer.capacity_tracker`` holds the policy's state.
"""

from __future__ import annotations

import numpy as np
import torch

from ..common.host_values import all_reduce_values
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

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        context, decision = self.context, call.decision
        indices = decision.indices.contiguous()
        num_experts = context.num_experts
        # Each expert's count and the token count, the maximum over ranks: the policy's input.
        counts = torch.bincount(indices[indices >= 0].reshape(-1), minlength=num_experts).cpu().numpy()
        mine = np.append(counts, indices.shape[0]).astype(np.int64)
        agreed = all_reduce_values(mine, context.comm, op="max")
        capacities = self.tracker.update(agreed[:num_experts], int(agreed[num_experts]), indices.shape[1])
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
