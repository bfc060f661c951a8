"""The staged MPI transport with 2, 3 and 4 ranks sharing one GPU (NCCL
refuses that): linear, 2DH (2 x 2, 3 x 1) and flexible all-to-all and
all-to-all-v on CUDA tensors, bitwise against the host communicator
(staged_ranks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from a2a import launch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("np_,local_size", [(2, 2), (4, 2), (3, 1)],
                         ids=["2 ranks on one node", "4 ranks as 2x2", "3 ranks as 3x1"])
def test_staged_mpi_on_one_gpu_matches_the_host(np_, local_size):
    env = dict(os.environ, STAGED_LOCAL_SIZE=str(local_size), A2A_TIMEOUT_S="120")
    env.pop("A2A_LOCAL_SIZE", None)
    command = launch.mpirun_command(np_, [sys.executable, os.path.join(HERE, "staged_ranks.py")])
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600)
    print(result.stdout[-6000:])
    assert result.returncode == 0, f"mpirun exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "total #wrong 0" in result.stdout
