"""The staging transports of the CUDA communicators, run with host copies
(A2A_TEST_STAGING; tests/run_mpi.py runs the whole suite in those modes):
checks that the mode is really in effect, and the cases particular to it."""

from __future__ import annotations

import os

import pytest
import reference as ref
from a2a_mpi_util import regular

import a2a

MODE = os.environ.get("A2A_TEST_STAGING", "")


def test_the_requested_staging_mode_is_in_effect(comm):
    # (256, size * 64) float32 split along 1, concatenated along 0: 256 blocks
    # of 256 bytes per peer, 64 KiB in all. Over MPI they travel as a datatype
    # (no workspace); the staged transport moves contiguous bytes only, so the
    # layout is packed through the workspace.
    size = comm.size
    workspace = comm._native.all_to_all_flex_workspace_size([256, size * 64], 1, 0, 0, 0)
    if MODE in ("staged", "predicted") or comm.transport == "external":  # external: torchrun's, contiguous only
        assert workspace > 0 or size == 1
    elif MODE in ("", "control"):
        assert workspace == 0 or size == 1


@pytest.mark.parametrize("rounds", [1, 3])
def test_back_to_back_exchanges_reuse_the_staging_buffer(comm, rounds):
    # Each round's receives are still being copied out of the staging buffer
    # when the next round's sends are copied in (on a GPU); on the host this
    # checks that growing and reusing the buffer keeps every round's data.
    for r in range(rounds):
        shape = (comm.size * (1 + 700 * r), 3)  # growing messages: the buffer is reallocated
        x = ref.a2a_input(f"staging{r}", comm.rank, comm.size, shape, "float64")
        want = ref.a2a_expected(f"staging{r}", comm.rank, comm.size, shape, "float64")
        for algo in ("linear", "2dh") if regular(comm) else ("linear",):
            ref.assert_bitwise_equal(a2a.all_to_all(x, comm=comm, algo=algo), want, f"round {r} {algo}")
