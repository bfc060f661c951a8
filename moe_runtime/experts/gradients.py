"""The gradients of what every rank holds alike (the gates, Hexa-MoE's fc2
bias): all-reduced as DDP would, while the expert shards' are complete already
(sync_shared_gradients); or by DDP itself, told to leave the expert shards
alone (ddp_ignore_experts)."""

from __future__ import annotations

import torch

import a2a

from .ffn import EXPERT_TAG

__all__ = ["ddp_ignore_experts", "sync_shared_gradients"]


def sync_shared_gradients(module: torch.nn.Module, comm: a2a.Comm) -> None:
    """All-reduces (mean over ranks) the gradients of every parameter of
    `module` that is not an expert shard, in one message per dtype, as DDP
    would. Collective: every rank calls it after backward. A missing gradient
    counts as zeros (and is set), so ranks stay in step."""
    shared = [p for p in module.parameters() if not getattr(p, EXPERT_TAG, False)]
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for parameter in shared:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        by_dtype.setdefault(parameter.grad.dtype, []).append(parameter)
    for dtype in sorted(by_dtype, key=str):
        parameters = by_dtype[dtype]
        flat = torch.cat([p.grad.reshape(-1) for p in parameters])
        a2a.all_reduce(flat, comm=comm, out=flat)
        flat /= comm.size
        offset = 0
        for parameter in parameters:
            count = parameter.grad.numel()
            parameter.grad.copy_(flat[offset : offset + count].view_as(parameter.grad))
            offset += count


def ddp_ignore_experts(model: torch.nn.Module) -> list[str]:
    """Tells torch's DistributedDataParallel to leave the expert shards of
    every MoE layer in `model` alone; call it before wrapping `model`. Without
    it DDP overwrites every rank's experts with rank 0's when it is made, and
    averages their gradients, which arrive complete: a wrong model, silently.
    DDP then all-reduces what sync_shared_gradients would (the gates). Adds
    the shards' names to the list DDP reads (``_ddp_params_and_buffers_to_ignore``,
    which Tutel's helloworld_ddp.py fills too) and returns them."""
    from torch.nn.parallel import DistributedDataParallel

    experts = [name for name, parameter in model.named_parameters() if getattr(parameter, EXPERT_TAG, False)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ignored += [name for name in experts if name not in ignored]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return experts
