"""One rank of tests/gpu/test_staged_mpi_gpu.py (run under mpirun, every
rank on the same GPU): every algorithm through the staged MPI transport on
CUDA tensors, compared bitwise with the host communicator on the same data
(rank_checks.py). Prints `#wrong N` per case on rank 0 and exits non-zero on
any difference."""

from __future__ import annotations

import os
import sys

from mpi4py import MPI
from rank_checks import Tally, every_algorithm

import a2a


def main() -> int:
    world = MPI.COMM_WORLD
    local_size = int(os.environ.get("STAGED_LOCAL_SIZE", "2"))
    host = a2a.Comm.from_mpi(world, local_size=local_size)
    cuda = a2a.Comm.from_mpi(world, device="cuda", transport="mpi", local_size=local_size, cuda_device=0)
    tally = Tally(world)
    every_algorithm(tally, "staged", host, cuda)
    return tally.finish(f"staged MPI on one GPU, {host.size} ranks, local_size {local_size}")


if __name__ == "__main__":
    sys.exit(main())
