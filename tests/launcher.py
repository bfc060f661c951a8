"""Which launcher started a multi-process suite (tests/run_mpi.py): mpirun, or
torchrun under A2A_TEST_LAUNCHER=torchrun (its torchrun-* configurations),
where the ranks share a gloo group and no MPI is beneath them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from a2a.launch import MPIRUN_PREFIXES, torchrun_command

TORCHRUN = os.environ.get("A2A_TEST_LAUNCHER") == "torchrun"


def rank_and_size(request: Any) -> tuple[int, int]:
    """This process's rank and the job's size, from torch.distributed under
    torchrun, else from the MPI world."""
    if TORCHRUN:
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    world = request.getfixturevalue("world")
    return world.Get_rank(), world.Get_size()


def job_comm(request: Any, make_from_mpi: Callable[[Any], Any], **torch_options: Any) -> Any:
    """The suite's communicator: over torchrun's gloo group
    (a2a.Comm.from_torch on the CPU, with torch_options), else make_from_mpi(world)."""
    if TORCHRUN:
        import a2a

        return a2a.Comm.from_torch(device="cpu", **torch_options)
    return make_from_mpi(request.getfixturevalue("world"))


def torchrun(np: int, argv: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node np argv...` as a user
    runs it, outside any mpirun (its variables dropped, and a2a's); `env` added."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith((*MPIRUN_PREFIXES, "A2A_"))}
    return subprocess.run(torchrun_command(np, [sys.executable, *argv]), capture_output=True, text=True, check=False,
                          timeout=timeout, env={**variables, **env})


ON_NAMESPACE_CLUSTER = os.environ.get("A2A_TEST_NAMESPACES") == "1"  # tests/run_mpi.py --cluster


def init_gloo_under_mpirun(world: Any, rank: int) -> None:
    """torch.distributed's default group over the mpi4py communicator `world`'s processes, gloo over TCP
    on this host's loopback (rank 0 picks the port), this process at torch rank `rank`. The caller
    destroys it. Not on the namespace cluster, where each node has a loopback of its own."""
    import torch.distributed as dist

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world.Get_size())
