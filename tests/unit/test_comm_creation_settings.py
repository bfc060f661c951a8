"""Communicator creation when ranks see different settings: every rank must
fail promptly with a clear error, none may hang. Runs small MPMD mpirun jobs
in which only rank 0 gets the odd environment variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from a2a.launch import find_mpirun, mpirun_command

SCRIPT = """
import a2a
from mpi4py import MPI
try:
    a2a.Comm.from_mpi()
    print(MPI.COMM_WORLD.rank, "created", flush=True)
except a2a.A2AError as e:
    print(MPI.COMM_WORLD.rank, type(e).__name__, e, flush=True)
"""


def run_two_ranks(rank0_env: dict[str, str], rank1_env: dict[str, str] | None = None) -> dict[int, str]:
    """Runs SCRIPT on 2 ranks with the given extra environments; returns each rank's line."""
    python = sys.executable
    first = mpirun_command(1, ["env", *(f"{k}={v}" for k, v in rank0_env.items()), python, "-c", SCRIPT])
    second = [":", "-np", "1", "env", *(f"{k}={v}" for k, v in (rank1_env or {}).items()), python, "-c", SCRIPT]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("A2A_", "OMPI_", "PMIX_"))}
    result = subprocess.run(first + second, capture_output=True, text=True, timeout=120, env=env, check=False)
    lines = {}
    for line in result.stdout.splitlines():
        rank, _, rest = line.partition(" ")
        if rank.isdigit():
            lines[int(rank)] = rest
    assert set(lines) == {0, 1}, result.stdout + result.stderr
    return lines


@pytest.fixture(scope="module", autouse=True)
def _needs_mpirun():
    try:
        find_mpirun()
    except FileNotFoundError as error:
        pytest.skip(str(error))


def test_bad_setting_on_one_rank_fails_every_rank():
    lines = run_two_ranks({"A2A_TIMEOUT_S": "abc"})
    assert lines[0].startswith("InvalidArgumentError") and "A2A_TIMEOUT_S='abc'" in lines[0]
    assert lines[1].startswith("RemoteError") and "rejected its settings" in lines[1]


def test_local_size_given_on_one_rank_only_is_a_mismatch():
    lines = run_two_ranks({"A2A_LOCAL_SIZE": "1"})
    for rank in (0, 1):
        assert lines[rank].startswith("MismatchError"), lines[rank]
        assert "given (local_size= / A2A_LOCAL_SIZE) on some ranks but not on others" in lines[rank]


def test_local_size_differing_across_ranks_is_a_mismatch():
    lines = run_two_ranks({"A2A_LOCAL_SIZE": "1"}, {"A2A_LOCAL_SIZE": "2"})
    for rank in (0, 1):
        assert lines[rank].startswith("MismatchError"), lines[rank]
        assert "local_size differs across ranks (from 1 to 2" in lines[rank]
