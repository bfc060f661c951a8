"""NCCL under mpirun on the one GPU: a communicator made over MPI and one
made from a torch.distributed NCCL process group (Comm.from_torch), every
algorithm bitwise against the host communicator, and CUDA-graph capture and
replay on both (nccl_ranks.py). One rank: NCCL refuses two ranks on one GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import a2a
from a2a import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def test_nccl_from_mpi_and_from_a_torch_nccl_group_match_the_host():
    if not a2a.config()["nccl"]:
        pytest.skip("a2a was built without NCCL (a2a.config()['nccl'] is False)")
    env = dict(os.environ, A2A_TIMEOUT_S="120")
    env.pop("A2A_LOCAL_SIZE", None)
    command = launch.mpirun_command(1, [sys.executable, os.path.join(HERE, "nccl_ranks.py")])
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    print(result.stdout[-6000:])
    assert result.returncode == 0, f"mpirun exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "total #wrong 0" in result.stdout
