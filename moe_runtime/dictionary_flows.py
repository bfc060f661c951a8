"""The dictionary's other flows on an expert-parallel layer:
``MoELayer(..., parallel_type="adaptive:auto", flows=("dropless",
"data_centric", "model_centric"))``.

The dictionary (moe_runtime.tuning.dictionary) then times, besides Tutel's (r, d,
algorithm), each of these flows once per capacity window and keeps the
fastest. Every flow runs on the layer's one parameter layout, Tutel's
whole experts (moe_runtime.experts.ffn.FFNExperts, n > 0 per rank), and
gathers what it needs from it:

- dropless (moe_runtime.deployment.dropless): the rows go to the rank of their expert
  by all_to_all_v and each rank computes its n experts as stored;
- data_centric (moe_runtime.hexa.flows): every rank's (n, H, M) all-gathered into
  the whole (E, H, M) in the pipeline-shared cache, this rank's tokens
  through it, the gradients reduce-scattered back;
- model_centric (moe_runtime.hexa.flows): rank w's hidden slice (E, H_w, M) of
  every expert by an all-to-all, every rank's tokens all-gathered, the
  partial outputs reduce-scattered.

They compute what the expert flow computes only when it drops nothing, so
the layer must route with the capacity that drops nothing (capacity factor
0), apply the gates after the experts (is_postscore), and hold whole
experts; :func:`check_layer` says which of these a layer misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import a2a

from .deployment.dropless import dropless_moe
from .experts.ffn import FFNExperts
from .hexa.cache import PipelineSharedCache
from .hexa.flows import data_centric_moe, model_centric_moe
from .tuning.dictionary import FLOWS

__all__ = ["OTHER_FLOWS", "check_capacity_factor", "check_layer", "checked_flows", "run_flow"]

OTHER_FLOWS = FLOWS[1:]  # "dropless", "data_centric", "model_centric"


def checked_flows(flows: Any) -> tuple[str, ...]:
    """The layer's flows= as a tuple in OTHER_FLOWS' order, after checking it."""
    if isinstance(flows, (str, bytes)) or not isinstance(flows, Sequence):
        raise TypeError(f"flows must be a list or tuple of {OTHER_FLOWS}, got {type(flows).__name__} {flows!r}")
    for flow in flows:
        if flow not in OTHER_FLOWS:
            raise ValueError(f"flows: unknown flow {flow!r}; the dictionary's other flows are {OTHER_FLOWS} (the "
                             "expert flow of (r, d, algorithm) is always among its choices)")
    if len(set(flows)) != len(flows):
        raise ValueError(f"flows has duplicates: {list(flows)}")
    return tuple(flow for flow in OTHER_FLOWS if flow in flows)


def check_layer(flows: tuple[str, ...], *, adaptive: bool, dispatcher: str, experts: FFNExperts,
                is_postscore: bool, batch_prioritized_routing: bool, capacity_factors: Sequence[float],
                world: int) -> None:
    """What an expert-parallel layer with `flows` must be, checked at construction."""
    name = f"MoELayer(flows={flows})"
    if not adaptive:
        raise ValueError(f"{name}: the flows are choices of the dictionary; construct the layer with "
                         "parallel_type='adaptive:auto' or adaptive=AdaptiveDictionary(...)")
    if dispatcher != "capacity":
        raise ValueError(f"{name} needs dispatcher='capacity' (the expert flow the others are timed against)")
    if experts.sharers > 1:
        raise ValueError(f"{name} needs whole experts on every rank (num_experts_per_device > 0: the layout every "
                         f"flow gathers from), but {experts.sharers} ranks share each expert")
    why = ("the other flows drop nothing, so they compute the expert flow's function only when it drops nothing "
           "either")
    for index, factor in enumerate(capacity_factors):
        if factor != 0:
            raise ValueError(f"{name}: gate {index} has capacity_factor={factor}; {why}: give capacity_factor=0 (the "
                             "smallest capacity that drops nothing; a negative factor caps it, and drops)")
    if not is_postscore:
        raise ValueError(f"{name}: the other flows apply the gates to the experts' outputs: is_postscore must be True")
    if batch_prioritized_routing:
        raise ValueError(f"{name}: nothing is dropped, so batch_prioritized_routing (which orders who is dropped) "
                         "has no meaning here")
    if "model_centric" in flows and experts.hidden_size < world:
        raise ValueError(f"{name}: model_centric gives every rank a hidden slice of every expert, but "
                         f"hidden_size_per_expert={experts.hidden_size} is smaller than the {world} ranks")


def check_capacity_factor(flows: tuple[str, ...], factor: float) -> None:
    """A call's capacity factor (its own or the gate's), for a layer with flows."""
    if flows and factor != 0:
        raise ValueError(f"MoELayer(flows={flows}): capacity_factor={factor} may drop choices, which the other flows "
                         "never do, so they would not compute the same function; call with capacity_factor=0")


def run_flow(flow: str, tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, *, experts: FFNExperts,
             comm: a2a.Comm, algo: str, token_counts: Sequence[int], cache: PipelineSharedCache | None,
             cache_token: int | None, weight_grad_scale: float) -> tuple[torch.Tensor, int, str, int]:
    """y (T, M) of `flow` on this rank's tokens; and for the plan, its r (1:
    dropless, 0: data-centric, W: model-centric), algorithm and rows sent."""
    indices = indices.contiguous()
    if flow == "dropless":
        y, _, sent = dropless_moe(tokens, indices, gates, weights=experts.local_weights(),
                                  activation=experts.activation_fn, comm=comm, algo=algo,
                                  weight_grad_scale=weight_grad_scale)
        return y, 1, algo, sent
    if flow == "data_centric":
        y = data_centric_moe(tokens, indices, gates, experts=experts, cache=cache, token=cache_token, comm=comm,
                             weight_grad_scale=weight_grad_scale)
        return y, 0, "linear", 0
    if flow == "model_centric":
        y = model_centric_moe(tokens, indices, gates, experts=experts, token_counts=token_counts, comm=comm,
                              weight_grad_scale=weight_grad_scale)
        return y, comm.size, "linear", tokens.shape[0] * (comm.size - 1)
    raise ValueError(f"unknown flow {flow!r}; the other flows are {OTHER_FLOWS}")
