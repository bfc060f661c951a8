"""NCCL under mpirun on the one GPU: a communicator made over MPI and one
made from a torch.distributed NCCL process group (Comm.from_torch), every
algorithm bitwise against the host communicator, and CUDA-graph capture and
replay on both (nccl_ranks.py). One rank: NCCL refuses two ranks on one GPU."""

from __future__ import annotations

import pytest
from rank_checks import run_under_mpirun

import a2a


def test_nccl_from_mpi_and_from_a_torch_nccl_group_match_the_host():
    if not a2a.config()["nccl"]:
        pytest.skip("a2a was built without NCCL (a2a.config()['nccl'] is False)")
    run_under_mpirun(1, "nccl_ranks.py", 300)
