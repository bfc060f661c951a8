"""The staged MPI transport with 2, 3 and 4 ranks sharing one GPU (NCCL
refuses that): linear, 2DH (2 x 2, 3 x 1) and flexible all-to-all and
all-to-all-v on CUDA tensors, bitwise against the host communicator
(staged_ranks.py)."""

from __future__ import annotations

import pytest
from rank_checks import run_under_mpirun


@pytest.mark.parametrize("np_,local_size", [(2, 2), (4, 2), (3, 1)],
                         ids=["2 ranks on one node", "4 ranks as 2x2", "3 ranks as 3x1"])
def test_staged_mpi_on_one_gpu_matches_the_host(np_, local_size):
    run_under_mpirun(np_, "staged_ranks.py", 600, STAGED_LOCAL_SIZE=str(local_size))
