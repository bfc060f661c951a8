"""The one window a kept agreement leaves to the timeout (moe_runtime/flows/kept.py):
a rank that skips the layer's call and makes another collective on the layer's
communicator meets no one, because the other ranks' first exchange runs on the
layer's exchange communicator. Every rank must still raise, at the timeout
(A2ATimeoutError), instead of hanging.

Messages stay in flight on the scenario's communicators, so tests/run_mpi.py
runs this in its timeout configurations' own mpirun (A2A_TEST_TIMEOUT=1), as
tests/mpi/test_mpi_timeout.py; elsewhere it is skipped. No assertion stands
between the ranks' calls: every rank reaches the timeout whatever another
found."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from runtime_util import make_layer, random_rows, suite_comm, whole_expert_cases

import a2a

pytestmark = pytest.mark.skipif(
    os.environ.get("A2A_TEST_TIMEOUT") != "1", reason="run by tests/run_mpi.py in a dedicated mpirun"
)

TIMEOUT_S = 1.0


def test_a_rank_that_skips_a_kept_call_ends_every_rank_at_the_timeout(world):
    comm = suite_comm(world, timeout_s=TIMEOUT_S)
    layer = make_layer(comm, whole_expert_cases(comm)[0])
    x = random_rows(8, seed=comm.rank)
    for _ in range(3):  # kept from the third call
        layer(x)
    skipping = comm.rank == comm.size - 1
    began = time.monotonic()
    with pytest.raises(a2a.A2ATimeoutError, match="timed out"):
        if skipping:
            a2a.all_reduce(np.ones(4), comm=comm)
        else:
            layer(x)
    assert time.monotonic() - began < 10 * TIMEOUT_S
