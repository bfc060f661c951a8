"""One a2a communicator per (group, device) for the Tutel surface.

Tutel's layers take ``group=`` (a torch.distributed group, None for the
whole job); a2a's collectives take an ``a2a.Comm``. Creating one is
collective and costs a communicator (NCCL's is not cheap), so every layer
and op of the same group and device shares one, made on first use by
``a2a.Comm.from_job`` (a2a/_job.py: MPI under mpirun, the gloo group's own
messages under torchrun on CPUs, NCCL over the group on CUDA). An ``a2a.Comm`` given as the group is used as it is.
"""

from __future__ import annotations

from typing import Any

import a2a

__all__ = ["communicator", "group_place", "group_size"]

# (group key, device, CUDA device) -> (the group, kept alive; its communicator)
_COMMUNICATORS: dict[tuple[Any, str, int], tuple[Any, a2a.Comm]] = {}


def _cuda_device(device: str) -> int:
    if device != "cuda":
        return -1
    import torch

    return torch.cuda.current_device()


def communicator(group: Any, device: str) -> a2a.Comm:
    """The communicator of `group` (None: the job) for tensors on `device`
    ("cpu" or "cuda"). Collective over the group the first time."""
    if isinstance(group, a2a.Comm):
        if group.device != device:
            raise ValueError(f"group is an a2a.Comm for {group.device} tensors, but the tensors are on {device}: "
                             "pass a communicator of their device, or group=None to let the layer make one")
        return group
    if group is None:  # the job's: torch.distributed's default group when it is initialized, else the MPI world
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (None if group is None else id(group), device, _cuda_device(device))
    held = _COMMUNICATORS.get(key)
    if held is None:
        held = (group, a2a.Comm.from_job(group, device=device))
        _COMMUNICATORS[key] = held
    return held[1]


def group_size(group: Any) -> int:
    """The number of ranks of `group` (None: the job), without making a communicator."""
    return group_place(group)[1]


def group_place(group: Any) -> tuple[int, int]:
    """(this rank's place in `group`, the group's size); None: the job's
    default group, or the MPI world when torch.distributed is not started."""
    if isinstance(group, a2a.Comm):
        return group.rank, group.size
    import torch.distributed as dist

    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
