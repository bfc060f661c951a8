"""Tutel's ``tutel.system``: starting the job's process groups, timing,
tensor files and per-rank file names. A Tutel program changes its import::

    from tutel import system                # before
    from moe_runtime.moe import system      # after

    parallel_env = system.init_data_model_parallel(backend="nccl" if cuda else "gloo")
    parallel_env.global_rank, parallel_env.local_device, parallel_env.dist_print(...)

init_data_model_parallel starts torch.distributed under torchrun or mpirun
(moe/groups.py; under mpirun without MASTER_ADDR set, where Tutel needs it),
and the layers of its groups move their bytes over a2a (moe/communicator.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import time
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from .groups import ParallelEnv, create_groups_from_world

__all__ = ["LocalCache", "apply_rank_size_from_pattern", "cache", "get_local_session",
           "init_affinity_at_program_beginning", "init_data_model_parallel", "load", "record_time", "save"]

_log = logging.getLogger(__name__)
_SESSION: list[ParallelEnv] = []  # the environment of init_data_model_parallel, once called


def init_affinity_at_program_beginning() -> None:
    """Binds this process to the CPUs of one NUMA node: node (LOCAL_RANK //
    NUMA_TYPE) % nodes (NUMA_TYPE default 1; <= 0, or TUTEL_CUDA_SANDBOX=1:
    nothing). A machine without NUMA information is left as it is, with a warning on local rank 0."""
    if int(os.environ.get("TUTEL_CUDA_SANDBOX", "0")):
        return
    numa_type = int(os.environ.get("NUMA_TYPE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if numa_type <= 0:
        return
    root = "/sys/devices/system/node"
    try:
        nodes = sorted(int(name[4:]) for name in os.listdir(root) if re.fullmatch(r"node\d+", name))
        node = nodes[(local_rank // numa_type) % len(nodes)]
        cpus = {int(name[3:]) for name in os.listdir(f"{root}/node{node}") if re.fullmatch(r"cpu\d+", name)}
        os.sched_setaffinity(0, cpus)
        _log.info("LOCAL_RANK %d bound to NUMA node %d (of %d)", local_rank, node, len(nodes))
    except (OSError, IndexError, ValueError) as error:
        if local_rank == 0:
            _log.warning("could not bind to a NUMA node: %s", error)


def init_data_model_parallel(group_count: int = 1, backend: str = "nccl") -> ParallelEnv:
    """Starts torch.distributed with `backend` ("nccl" or "gloo") where a
    launcher started this process, makes the data and model groups of
    `group_count` model groups (moe/groups.py) and returns their
    environment, also kept as :func:`get_local_session`'s."""
    env = create_groups_from_world(group_count, include_init=backend)
    env.is_cuda = env.local_device is not None and env.local_device.type == "cuda"
    _log.info("rank %d of %d: data rank %d, model rank %d", env.global_rank, env.global_size, env.data_rank,
              env.model_rank)
    if not _SESSION:
        atexit.register(_quit)
    _SESSION[:] = [env]
    return env


def _quit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_local_session() -> ParallelEnv:
    """The environment of the last init_data_model_parallel."""
    if not _SESSION:
        raise RuntimeError("get_local_session: call system.init_data_model_parallel() first (or "
                           "system.record_time(is_cuda=False) to time without it)")
    return _SESSION[0]


def record_time(is_cuda: bool | None = None) -> float:
    """time.time() after the device's work is done (`is_cuda` None: the session's device)."""
    if get_local_session().is_cuda if is_cuda is None else is_cuda:
        torch.cuda.synchronize()
    return time.time()


class LocalCache:
    """A process-wide dictionary (Tutel's): get(key) the value, get(unknown or None) every value."""

    _CACHE: ClassVar[dict[Any, Any]] = {}

    @staticmethod
    def reset() -> None:
        LocalCache._CACHE = {}

    @staticmethod
    def set(key: Any, val: Any) -> None:
        LocalCache._CACHE[key] = val

    @staticmethod
    def get(key: Any = None) -> Any:
        if key not in LocalCache._CACHE:
            return list(LocalCache._CACHE.values())
        return LocalCache._CACHE[key]


def cache() -> type[LocalCache]:
    return LocalCache


def save(t: torch.Tensor, path: str) -> None:
    """The tensor as a NumPy .npy file."""
    np.save(path, t.detach().cpu().numpy())


def load(path: str, device: Any = None) -> torch.Tensor:
    """A tensor from a NumPy .npy file, on `device`."""
    return torch.tensor(np.load(path), device=device)


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """`filename` with {rank} and {size} replaced (a warning when it has no
    {rank}: the ranks would share the file); its directory made if `create_dir`."""
    if "{rank}" not in filename:
        _log.warning("the file pattern %s has no {rank}: every rank would use the same file", filename)
    filename = filename.replace("{size}", str(size)).replace("{rank}", str(rank))
    directory = os.path.dirname(filename)
    if create_dir and directory:
        os.makedirs(directory, exist_ok=True)
    return filename
