"""An MoELayer's flows bound to its communicator: made at construction, and
again by ``MoELayer.use_comm`` when the layer moves to another communicator
of the same ranks (the CUDA one after ``layer.cuda()``, say)."""

from __future__ import annotations

from typing import Any

import a2a

from .common.overlap import Overlap
from .flows.base import Context, Flow
from .flows.kept import KeptAgreement
from .registry import FLOWS

__all__ = ["bind_flows", "check_rebind"]

# The flows that keep nothing between calls but what the layer holds: they can be made anew on another communicator.
REBINDABLE = ("expert", "dropless")


def bind_flows(layer: Any, comm: a2a.Comm, flow_class: type[Flow], settings: Any,
               others: dict[str, Any]) -> tuple[Flow, dict[str, Flow]]:
    """Collective: the layer's flow and every flow it may run, by name (its
    own, and the dictionary's others over the same experts), on `comm`. The
    exchanges get their own communicator (``Comm.split``), so that a
    communication thread never shares one with the caller."""
    exchange_comm = comm.split(0, comm.rank)
    context = Context(comm, exchange_comm, Overlap(comm.device, comm.cuda_device), layer._pool,
                      layer.experts, layer.num_global_experts, layer.model_dim, "2dh" if layer.use_2dh else "linear",
                      1.0 / comm.size if layer.expert_gradient == "mean" else 1.0, layer.is_postscore,
                      layer.batch_prioritized_routing, layer.timer, layer.dispatch_format,
                      KeptAgreement(comm.host_twin(), exchange_comm))
    flow = flow_class(context, settings)
    flows = {flow.name: flow}
    flows.update((name, FLOWS[name](context, others[name])) for name in others)
    return flow, flows


def check_rebind(layer: Any, comm: a2a.Comm) -> None:
    """Why `layer` cannot move to `comm` (raises), if it cannot."""
    if not isinstance(comm, a2a.Comm):
        raise TypeError(f"use_comm takes an a2a.Comm, got {type(comm).__name__}")
    if (comm.size, comm.rank) != (layer.comm.size, layer.comm.rank):
        raise ValueError(f"use_comm: the new communicator is rank {comm.rank} of {comm.size}, the layer's is rank "
                         f"{layer.comm.rank} of {layer.comm.size}: it must have the same ranks in the same order")
    keeping = [name for name in layer._flows if name not in REBINDABLE]
    if keeping or layer.expert_cache is not None or layer.assignment_cache is not None:
        raise ValueError(f"use_comm: this layer's flows ({sorted(layer._flows)}, with their caches) keep state "
                         f"between calls; only {REBINDABLE} without caches move to another communicator: construct "
                         "the layer on the communicator of its device")
