"""The gradients of what every rank holds alike (the gates, Hexa-MoE's fc2
bias): all-reduced as DDP would, while the expert shards' are complete already."""

from __future__ import annotations

import torch

import a2a

from .ffn import EXPERT_TAG

__all__ = ["sync_shared_gradients"]


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
