"""Tutel's process groups (``tutel.net.create_groups_from_world``, under
``tutel.system.init_data_model_parallel``): torch.distributed started from the
launcher's variables, and the data and model groups of a 2-D split of the
world.

With W ranks and G = group_count (G < 0: W / -G), rank g of the world is

    model rank  g % (W / G)   in model group g // (W / G): the W / G consecutive ranks
    data rank   g // (W / G)  in data group  g % (W / G):  the G ranks W / G apart

(Tutel's names: the model group shards the experts, the data group replicates
them). The launchers:

    torchrun (RANK, WORLD_SIZE, LOCAL_RANK)   init_process_group from the environment
    mpirun (OMPI_COMM_WORLD_*, ...)           rank and size from mpirun; MASTER_ADDR and
                                              MASTER_PORT from the environment, else a free
                                              port of rank 0's host, broadcast over MPI (Tutel
                                              needs them set)
    nothing                                   one process, not distributed: groups None

A torch.distributed the program started itself is used as it is (Tutel
raises there). ``TUTEL_GLOBAL_TIMEOUT_SEC`` (default 86400) bounds the start
and the groups' creation, as in Tutel.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from a2a.launch import free_port, under_mpirun

__all__ = ["ParallelEnv", "create_groups_from_world", "create_standalone_group"]

BACKENDS = ("nccl", "gloo")
# Every group_count's environment, and under "" the backend the world was started with.
_MADE: dict[Any, Any] = {}


@dataclass
class ParallelEnv:
    """What ``create_groups_from_world`` returns (Tutel's attribute names)."""

    global_size: int
    global_rank: int
    group_count: int  # the number of model groups (G)
    data_rank: int
    model_size: int
    model_rank: int
    local_device: torch.device | None  # cuda:LOCAL_RANK for "nccl", cpu for "gloo", None without a backend
    data_group: Any
    model_group: Any
    global_group: Any
    is_distributed: bool
    dist_print: Callable[..., None]
    is_cuda: bool = False  # set by system.init_data_model_parallel


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=int(os.environ.get("TUTEL_GLOBAL_TIMEOUT_SEC", "86400")))


@dataclass(frozen=True)
class _Launch:
    rank: int
    size: int
    local_rank: int
    one_host: bool  # every rank on this host


def _launched() -> _Launch | None:
    """This process's place from the launcher's variables; None when nothing launched it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, or any env:// launcher
        size = int(os.environ["WORLD_SIZE"])
        one_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == size
        return _Launch(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")), one_host)
    if under_mpirun():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        launch = _Launch(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size() == world.Get_size())
        local.Free()
        return launch
    return None


def _start(backend: str, launch: _Launch) -> None:
    """init_process_group for `backend` at the launcher's rank and size."""
    if "MASTER_ADDR" in os.environ or not under_mpirun():  # env:// (torchrun sets both)
        os.environ.setdefault("MASTER_PORT", "23456")  # Tutel's default
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.size, timeout=_timeout())
        return
    from mpi4py import MPI

    address = None
    if launch.rank == 0:  # a port free on rank 0's host now; the others learn it by MPI
        address = ("127.0.0.1" if launch.one_host else socket.gethostname(), free_port())
    host, port = MPI.COMM_WORLD.bcast(address)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=launch.rank, world_size=launch.size,
                            timeout=_timeout())


def create_groups_from_world(group_count: int, include_init: str | None = None,
                             parent_group: Any = None) -> ParallelEnv:
    """The environment of `group_count` model groups (see the module
    docstring), made once per count; `include_init`: the backend ("nccl",
    "gloo") to start torch.distributed with, when it is not started yet.
    Collective the first time for a count (every rank makes every group)."""
    if parent_group is not None:
        raise ValueError("create_groups_from_world: parent_group is not supported (nor in Tutel): the groups split "
                         "the whole world")
    if isinstance(group_count, bool) or not isinstance(group_count, int) or group_count == 0:
        raise ValueError(f"create_groups_from_world: group_count must be a nonzero integer, got {group_count!r}")
    if include_init is not None and include_init not in BACKENDS:
        raise ValueError(f"create_groups_from_world: unsupported backend {include_init!r}; use one of {BACKENDS}")
    if include_init == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("create_groups_from_world: backend 'nccl' needs a CUDA device, and torch sees none here; "
                           "use backend='gloo' on CPUs")
    backend = _MADE.get("") or include_init
    if include_init is not None:
        if include_init != backend:
            raise ValueError(f"create_groups_from_world: the world was started with backend {backend!r}, "
                             f"not {include_init!r}: one backend per job")
        _MADE[""] = include_init
    made = _MADE.get(group_count)
    if made is not None and (include_init is None or made.local_device is not None):
        return made  # (one made before any backend was named is made again with it)

    launch = _launched()
    if include_init is not None and not dist.is_initialized() and launch is not None and launch.size > 1:
        _start(include_init, launch)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    local_rank = launch.local_rank if launch is not None else 0

    groups = world // -group_count if group_count < 0 else group_count
    if groups <= 0 or world % groups:
        raise ValueError(f"create_groups_from_world: cannot split the world of {world} ranks into {groups} groups "
                         f"of equal size (group_count {group_count})")
    model_size = world // groups
    model_group = data_group = global_group = dist.group.WORLD if distributed else None
    if distributed and model_size != world:  # every rank makes every group, in the same order
        made = [dist.new_group(list(range(g * model_size, (g + 1) * model_size)), timeout=_timeout())
                for g in range(groups)]
        model_group = made[rank // model_size]
    if distributed and groups != world:
        made = [dist.new_group(list(range(m, world, model_size)), timeout=_timeout()) for m in range(model_size)]
        data_group = made[rank % model_size]

    if backend == "nccl":
        device = torch.device("cuda", min(local_rank, max(torch.cuda.device_count() - 1, 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu") if backend == "gloo" else None

    def dist_print(*text: Any) -> None:
        if rank == 0:
            print(*text, flush=True)

    env = ParallelEnv(world, rank, groups, rank // model_size, model_size, rank % model_size, device, data_group,
                      model_group, global_group, distributed, dist_print if distributed else print)
    _MADE[group_count] = env
    return env


def create_standalone_group() -> Any:
    """A group of this rank alone (collective: every rank makes every rank's);
    None when torch.distributed is not started."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    made = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return made[dist.get_rank()]
