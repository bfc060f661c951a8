"""The debug channel (A2A_DEBUG, csrc/core/debug.hpp): rank-prefixed lines on
stderr, silent by default, read when a communicator is created. (Its WARN
lines on timeouts are checked under mpirun: tests/mpi/test_mpi_timeout.py.)"""

from __future__ import annotations

import pytest
from checks import raises_invalid

import a2a


@pytest.fixture
def debug_env(monkeypatch, mpi):
    """Sets A2A_DEBUG for the test; afterwards a communicator made without it
    puts the process back to silent (the level is read at creation)."""
    yield lambda value: monkeypatch.setenv("A2A_DEBUG", value)
    monkeypatch.delenv("A2A_DEBUG", raising=False)
    a2a.Comm.from_mpi(mpi.COMM_SELF)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[a2a")]


def test_silent_by_default(mpi, capfd, monkeypatch):
    monkeypatch.delenv("A2A_DEBUG", raising=False)
    a2a.Comm.from_mpi(mpi.COMM_SELF)
    a2a.Comm.from_mpi(mpi.COMM_SELF, local_size=1)
    assert lines(capfd.readouterr().err) == []


@pytest.mark.parametrize("value", ["INFO", "info"])
def test_info_reports_creation_topology_and_transports(mpi, capfd, debug_env, value):
    debug_env(value)
    a2a.Comm.from_mpi(mpi.COMM_SELF)
    a2a.Comm.from_mpi(mpi.COMM_SELF, local_size=1)
    detected, given = lines(capfd.readouterr().err)
    rank = mpi.COMM_WORLD.Get_rank()
    for line in (detected, given):
        assert line.startswith(f"[a2a rank {rank}] INFO communicator created from MPI: rank 0 of 1, "), line
        assert "1 nodes x 1 ranks" in line, line
        assert "data transport mpi, control transport mpi, device cpu, timeout" in line, line
        assert line.endswith(", MPI_THREAD_MULTIPLE"), line
    assert "(local_size from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED))" in detected, detected
    assert "(local_size from local_size=)" in given, given


def test_info_says_where_an_environment_local_size_came_from(mpi, capfd, debug_env, monkeypatch):
    debug_env("INFO")
    monkeypatch.setenv("A2A_LOCAL_SIZE", "1")
    a2a.Comm.from_mpi(mpi.COMM_SELF, timeout_s=7)
    (line,) = lines(capfd.readouterr().err)
    assert "(local_size from A2A_LOCAL_SIZE)" in line and "timeout 7 s" in line, line


def test_warn_level_leaves_out_info(mpi, capfd, debug_env):
    debug_env("WARN")
    a2a.Comm.from_mpi(mpi.COMM_SELF)
    assert lines(capfd.readouterr().err) == []


def test_an_unknown_level_fails_creation_naming_the_accepted_ones(mpi, debug_env):
    debug_env("verbose")
    raises_invalid(lambda: a2a.Comm.from_mpi(mpi.COMM_SELF), "A2A_DEBUG='verbose'", "WARN, INFO")
