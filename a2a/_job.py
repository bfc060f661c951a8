"""The running job's communicator over a torch.distributed group, or over the
MPI world: what ``Comm.from_job`` resolves (launcher x backend x device).

======================  ==========================  ================================================
launched by             torch.distributed            device="cpu" (MPI)          device="cuda" (NCCL)
======================  ==========================  ================================================
mpirun                  not initialized              MPI_COMM_WORLD              NCCL over MPI_COMM_WORLD
mpirun                  initialized (any backend)    the MPI sub-communicator    NCCL over the group
                                                     of the group's ranks         (Comm.from_torch)
torchrun                initialized (any backend)    refused: no MPI beneath     NCCL over the group
nothing (one process)   not initialized              a world of one              NCCL, one rank
======================  ==========================  ================================================

Under mpirun a torch group's ranks are mapped onto MPI ranks by an
all-gather over the group itself (each member's MPI world rank, in group
order), and the sub-communicator is created by its members alone
(``MPI_Comm_create_group``), so ranks outside the group need not take part.
"""

from __future__ import annotations

import os
from typing import Any

from .launch import under_mpirun


def torch_group(group: Any) -> Any:
    """The torch.distributed group to use: `group`, or the default group when
    torch.distributed is initialized, else None (the MPI world)."""
    if group is not None:
        return group
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def mpi_ranks_of(group: Any) -> list[int]:
    """The MPI world rank of each member of a torch group, in group order
    (collective over the group)."""
    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != dist.get_world_size():
        raise RuntimeError(
            f"the MPI world has {world.Get_size()} ranks but torch.distributed's has {dist.get_world_size()}: "
            "launch the job with one mpirun whose ranks are torch.distributed's ranks"
        )
    ranks: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, world.Get_rank(), group=group)
    return [int(rank) for rank in ranks]


def mpi_comm_of(group: Any) -> Any:
    """The MPI communicator of `group`'s ranks, in group order (None: the world)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if group is None:
        return world
    ranks = mpi_ranks_of(group)
    if ranks == list(range(world.Get_size())):
        return world
    members = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(members)
    finally:
        members.Free()


def backend_of(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


def cpu_refusal(group: Any) -> str:
    """Why a CPU communicator cannot serve `group` (None when it can)."""
    if under_mpirun():
        return ""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1 and dist.get_world_size() == 1:
        return ""  # a job of one process: the MPI world of one serves it
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ \
        else "a launcher other than mpirun"
    return (f"the torch.distributed group (backend {backend_of(group)!r}, {dist.get_world_size(group)} ranks) was "
            f"started by {launcher}, and a2a's CPU collectives need MPI beneath it: launch the same program with "
            "mpirun (e.g. `python -m a2a.launch --np N -- python prog.py`; gloo may stay initialized), or run "
            "on CUDA tensors (device='cuda': NCCL over the group)")
