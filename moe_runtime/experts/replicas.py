"""The parameters that more than one rank holds whole, made the same on every
rank at construction: one model, whatever the seeds.

A layer's parameters are either expert shards (tagged ``EXPERT_TAG``: each
part of an expert held by one rank; their gradients are complete where they
are) or held whole by every rank: the gates, and the parts of an expert
layout that every rank keeps whole, tagged ``REPLICATED_TAG`` (Hexa-MoE's
fc2 bias, moe_runtime.hexa.experts). Seeded per rank (Tutel's convention
passes ``seeds=(1, rank + 1)``), or with gate seeds that differ, those would
start different on each rank, and all-reducing their gradients keeps them
apart for ever: the same token would get another output on every rank.

:func:`copy_replicas_from_rank0` gives them rank 0's values, bit for bit,
in one all-reduce (sum) of their bytes read as int64, to which only rank 0
contributes (a broadcast by the collectives a2a has; integers, so that
nothing is rounded and a -0.0 stays -0.0). FlexMoE's vExpert replicas need
nothing here: at construction every expert has one slot, and a replica is
made by copying its slot (moe_runtime.experts.relocation.copy_slots).
"""

from __future__ import annotations

import torch

import a2a

from ..common.host_values import torch_device
from .ffn import EXPERT_TAG

__all__ = ["REPLICATED_TAG", "copy_replicas_from_rank0", "replicated_parameters"]

REPLICATED_TAG = "_moe_replicated"  # set on an expert-tagged parameter that every rank holds whole


def replicated_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of `module` that every rank holds whole: those not
    tagged as expert shards, and those tagged REPLICATED_TAG."""
    return [p for p in module.parameters() if not getattr(p, EXPERT_TAG, False) or getattr(p, REPLICATED_TAG, False)]


def copy_replicas_from_rank0(module: torch.nn.Module, comm: a2a.Comm) -> None:
    """Collective: every parameter of :func:`replicated_parameters` takes
    rank 0's values (bit for bit), in one all-reduce on `comm`'s device."""
    parameters = replicated_parameters(module)
    if comm.size == 1 or not parameters:
        return
    device = torch_device(comm)
    with torch.no_grad():
        pieces = [p.detach().reshape(-1).view(torch.uint8).to(device) for p in parameters]
        flat = torch.cat(pieces)
        padded = torch.zeros(-(-flat.numel() // 8) * 8, dtype=torch.uint8, device=device)
        if comm.rank == 0:
            padded[: flat.numel()] = flat
        words = padded.view(torch.int64)
        a2a.all_reduce(words, comm=comm, out=words)
        offset = 0
        for parameter, piece in zip(parameters, pieces):
            count = piece.numel()
            values = padded[offset : offset + count].clone().view(parameter.dtype).view_as(parameter)
            parameter.copy_(values)
            offset += count
