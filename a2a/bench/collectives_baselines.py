"""The baselines of the collectives sweep (``--baseline``): MPI_Alltoall,
torch.distributed's gloo and, on CUDA, a device-to-device copy; which apply
to a run, how the header describes them, and gloo's process group."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["A2A_OVER_GLOO", "BASELINE", "BASELINES", "D2D_BASELINE", "GLOO_BASELINE", "HOST_BASELINES", "describe",
           "resolve_baselines", "start_gloo"]

BASELINE = "mpi"  # MPI_Alltoall on host buffers
GLOO_BASELINE = "gloo"  # torch.distributed.all_to_all_single over gloo, on CPU tensors
# With the gloo baseline, a row of ours too: a2a's linear all-to-all over the same gloo group
# (a2a.Comm.from_torch(device="cpu"), the transport torchrun jobs get): each choice's cost in one run.
A2A_OVER_GLOO = "a2a/gloo"
D2D_BASELINE = "d2d"  # --device cuda: a device-to-device copy of the same bytes
BASELINES = (BASELINE, GLOO_BASELINE, D2D_BASELINE)
HOST_BASELINES = (BASELINE, GLOO_BASELINE)  # --device cpu


def resolve_baselines(text: str | None, *, device: str, no_baseline: bool, have_torch: bool) -> list[str]:
    """The baselines of --baseline (a comma list, or none), checked against
    the device. Raises ValueError."""
    default = D2D_BASELINE if device == "cuda" else BASELINE
    if text is None:
        return [] if no_baseline else [default]
    names: list[str] = []
    for name in (part.strip().lower() for part in text.split(",")):
        if name not in (*BASELINES, "none"):
            raise ValueError(f"--baseline: unknown baseline {name!r}; expected mpi, gloo, d2d or none, or a comma list")
        if name not in names:
            names.append(name)
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--baseline: none cannot be combined with {', '.join(n for n in names if n != 'none')}")
        return []
    if no_baseline:
        raise ValueError(f"--no-baseline contradicts --baseline {text}")
    allowed = (D2D_BASELINE,) if device == "cuda" else HOST_BASELINES
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"--baseline {name} does not apply to --device {device}: "
                + ("a device-to-device copy needs --device cuda" if name == D2D_BASELINE
                   else "it moves host buffers; --device cuda compares with d2d")
            )
    if GLOO_BASELINE in names and not have_torch:
        raise ValueError("--baseline gloo needs torch (torch.distributed's gloo backend): pip install torch "
                         "(or pip install 'a2a[torch]')")
    return names


def describe(baseline: str) -> str:
    """The header's line for `baseline`: what it runs, with which versions."""
    if baseline == D2D_BASELINE:
        return "d2d = one device-to-device copy of the same bytes (torch copy_); vs D2D = algbw / its algbw"
    if baseline == A2A_OVER_GLOO:
        return (f"{A2A_OVER_GLOO} = a2a's linear all-to-all over the same gloo group (Comm.from_torch(device='cpu'), "
                "the transport of a torchrun job on CPUs)")
    if baseline == GLOO_BASELINE:
        import torch

        return f"gloo = torch {torch.__version__} distributed.all_to_all_single over gloo, on CPU tensors"
    return f"mpi = MPI_Alltoall via mpi4py {mpi4py_version()} on {mpi_library()}"


def start_gloo(world: Any, args: Any) -> Callable[[], None]:
    """torch.distributed over gloo on the ranks of `world` (rank and size
    from MPI). Rank 0 opens the rendezvous store (MASTER_ADDR / MASTER_PORT
    if set, else its host name and a free port) and tells the others where
    it is over MPI. Every wait is bounded by A2A_TIMEOUT_S. With linear among
    args.algos, an a2a communicator over the group too (args.gloo_comm) and
    its row (A2A_OVER_GLOO). Returns the teardown, which joins gloo's threads."""
    import datetime

    import torch.distributed as dist

    rank, size = world.Get_rank(), world.Get_size()
    if not dist.is_available() or not dist.is_gloo_available():
        raise SystemExit("a2a.bench: --baseline gloo needs torch.distributed with the gloo backend, "
                         "which this torch build lacks")
    timeout = datetime.timedelta(seconds=timeout_s())
    store, where = None, None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        try:
            store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT", "0")), size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            where = (host, store.port, None)
        except Exception as error:  # noqa: BLE001 - sent to the other ranks, then raised everywhere
            where = (host, None, f"{type(error).__name__}: {error}")
    host, port, problem = world.bcast(where, root=0)
    if problem is not None:
        raise RuntimeError(f"a2a.bench: --baseline gloo: rank 0 could not open a TCPStore on {host}: {problem}")
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    if "linear" in args.algos:  # ours over the same group, beside gloo's own all-to-all
        import a2a

        args.gloo_comm = a2a.Comm.from_torch(device="cpu", local_size=args.local_size)
        args.algos = [*args.algos, A2A_OVER_GLOO]
    return dist.destroy_process_group


def timeout_s() -> float:
    """A2A_TIMEOUT_S, else a2a's default of 300 s."""
    text = os.environ.get("A2A_TIMEOUT_S")
    try:
        value = float(text) if text else 300.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"a2a.bench: A2A_TIMEOUT_S={text!r} is not a positive number of seconds")
    return value


def mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()


def mpi4py_version() -> str:
    import mpi4py

    return mpi4py.__version__
