"""Runs pytest on one rank (started by tests/run_mpi.py under mpirun, or
under torchrun for its torchrun-* configurations).

    mpirun -np N python tests/mpi/_rank_pytest.py --log-dir DIR -- PYTEST_ARGS...
    torchrun --nproc_per_node N tests/mpi/_rank_pytest.py --log-dir DIR -- PYTEST_ARGS...

Rank 0 keeps its stdout/stderr (the console); every other rank writes to
DIR/rank<r>.log, at the file-descriptor level so that output from MPI and
native code lands there too. Each rank records pytest's exit code in
DIR/rank<r>.rc. Before exiting, the ranks wait for each other, so that one
rank's early non-zero exit cannot make mpirun kill the others mid-test.
"""

from __future__ import annotations

import os
import sys

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK")  # RANK: torchrun's


def world_rank() -> int:
    for key in RANK_VARIABLES:
        value = os.environ.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def parse(argv: list[str]) -> tuple[str, list[str]]:
    log_dir = os.path.join("build", "test-logs", "mpi")
    if argv[:1] == ["--log-dir"] and len(argv) >= 2:
        log_dir, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return log_dir, argv


def main(argv: list[str]) -> int:
    log_dir, pytest_args = parse(argv)
    # The MPI thread level to ask for (tests/run_mpi.py's threads-serialized);
    # mpi4py reads it when MPI starts, at its first import.
    thread_level = os.environ.get("A2A_TEST_MPI_THREAD_LEVEL")
    if thread_level:
        import mpi4py

        mpi4py.rc.thread_level = thread_level
    rank = world_rank()
    os.makedirs(log_dir, exist_ok=True)
    if rank > 0:
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    import pytest

    code = int(pytest.main(pytest_args))
    with open(os.path.join(log_dir, f"rank{rank}.rc"), "w") as f:
        f.write(f"{code}\n")
    sys.stdout.flush()
    sys.stderr.flush()

    if os.environ.get("A2A_TEST_LAUNCHER") == "torchrun":
        import torch.distributed as dist

        if dist.is_initialized():  # the suite's conftest started it (tests/conftest.py)
            dist.barrier()
            dist.destroy_process_group()
        return code
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
