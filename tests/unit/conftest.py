"""Single-process tests: a 1-rank communicator (MPI.COMM_SELF)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mpi():
    from mpi4py import MPI

    return MPI


@pytest.fixture(scope="session")
def comm(mpi):
    """A 1-rank a2a.Comm over COMM_SELF (MPI datatypes on)."""
    import a2a

    return a2a.Comm.from_mpi(mpi.COMM_SELF)


@pytest.fixture(scope="session")
def comm_copies(mpi):
    """A 1-rank a2a.Comm that packs strided layouts with copies."""
    import a2a

    return a2a.Comm.from_mpi(mpi.COMM_SELF, use_mpi_datatypes=False)


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def launched(monkeypatch):
    """Replaces a2a.launch.run for the benches' relaunch under mpirun;
    records (np, command, env)."""
    from a2a import launch
    from a2a.bench import common

    calls = []
    monkeypatch.setattr(launch, "under_mpirun", lambda: False)
    monkeypatch.setattr(launch, "run", lambda np, command, env=None: calls.append((np, command, env)) or 0)
    monkeypatch.delenv("A2A_LOCAL_SIZE", raising=False)
    monkeypatch.delenv(common.COMMAND_ENV, raising=False)
    return calls
