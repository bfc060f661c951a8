"""FlexMoE's flow (``MoELayer(flow=FlexConfig(...))``), as a
:class:`moe_runtime.flows.base.Flow`.

The experts are this rank's vExpert slots (moe_runtime.flex.vexperts); each
call routes every choice to a replica of its expert, locality first
(Algorithm 3, moe_runtime.flex.routing), runs the dropless exchange to that
plan (moe_runtime.flex.dispatch) and feeds the scheduler the step's
measurements (moe_runtime.flex.state). ``layer.rebalance(optimizer)`` and
``layer.adjust(primitives)`` change the slots between steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import a2a

from ..experts.ffn import FFNExperts
from ..flows.base import Call, Plan, WholeExpertFlow, whole_expert_layer
from .config import FlexConfig
from .dispatch import flex_moe
from .state import FlexState

__all__ = ["FlexFlow"]


class FlexFlow(WholeExpertFlow):
    """Dropless over vExpert replicas of hot experts; r = 1, d = 1."""

    name = "flex"
    times_steps = True  # the replica scheduler's cost model is calibrated on the steps' times

    def __init__(self, context, settings: FlexConfig | None = None):
        super().__init__(context, settings or FlexConfig())
        self.state: FlexState = context.experts.flex_state
        self.state.timer = context.timer  # the layer's clock, which the layout had not yet

    @classmethod
    def layout(cls, spec: dict[str, Any], model_dim: int, comm: a2a.Comm, expert_seed: int,
               settings: FlexConfig) -> FFNExperts:
        """This rank's vExpert slots, with the FlexMoE state that places them."""
        settings = FlexConfig() if settings is None else settings  # flow="flex": the defaults
        if not isinstance(settings, FlexConfig):
            raise TypeError(f"FlexMoE's settings must be a moe_runtime.FlexConfig, got {type(settings).__name__}")
        plain = FFNExperts(spec, model_dim, comm, expert_seed)
        if plain.sharers > 1:
            raise ValueError(f"MoELayer(flow='flex') needs whole experts on each rank (E >= W), but {plain.sharers} "
                             f"ranks share each of the {plain.num_experts} experts")
        state = FlexState(settings, comm=comm, num_experts=plain.num_experts, experts_per_rank=plain.num_local,
                          model_dim=model_dim, hidden=plain.hidden_size,
                          with_biases=(plain.batched_fc1_bias is not None, plain.batched_fc2_bias is not None),
                          timer=time.perf_counter)
        slots = FFNExperts(spec, model_dim, comm, expert_seed, slots=state.table.slots[comm.rank].tolist())
        slots.flex_state = state
        return slots

    @classmethod
    def check_layer(cls, layer: Any) -> None:
        whole_expert_layer(cls.name, layer)
        if not layer.is_postscore or layer.batch_prioritized_routing:
            raise ValueError("MoELayer(flow='flex') drops nothing and applies the gates at the combine: "
                             "is_postscore must be True and batch_prioritized_routing False")

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        """The plan of Algorithm 3 over the vExpert slots, then the dropless flow to it."""
        context, algo = self.context, call.choice.algo
        weights = self.whole_expert_weights(call.tokens.dtype)
        indices = call.decision.indices.contiguous()
        # A slot's states when it moves: parameters, gradients and (Adam's) two moments.
        state_bytes = 4 * self.state.expert_elements * weights[0].element_size()
        sends, sync = self.state.begin(indices, call.step_seconds, call.tokens.element_size(), state_bytes, algo,
                                       recording=call.recording)
        y = flex_moe(call.tokens, indices, call.decision.gates, sends=sends, weights=weights, sync=sync,
                     activation=context.experts.activation_fn, comm=context.exchange_comm, algo=algo,
                     weight_grad_scale=context.weight_grad_scale)
        rank = context.comm.rank
        most = int(sends.sum(axis=(0, 1)).max())
        sent = int(sends[:, rank, :].sum() - sends[:, rank, rank].sum())
        return y, Plan(1, 1, algo, most, most, 0, sent, flow=self.name)
