"""Fixtures for the suite that runs under mpirun (any world size, any topology).

Every rank runs the same tests in the same order; every decision to skip
depends only on values that are equal on all ranks (size, topology, env).
"""

from __future__ import annotations

import os
import sys

import pytest
from launcher import TORCHRUN, job_comm

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# A2A_TEST_STAGING=staged|predicted|control (tests/run_mpi.py's staged-*,
# predicted-* and control-* configurations): every host communicator the suite makes, through
# a2a.Comm.from_mpi or otherwise, moves its data (or its control values)
# through the staging transports of the CUDA communicators, with host copies.
# The library itself never reads this variable: its native constructor is
# replaced by the test-only factory (csrc/setup/testing_comm.hpp).
STAGING = os.environ.get("A2A_TEST_STAGING", "")


class _StagedNativeComm:
    """Stands in for a2a._C.Comm: the same arguments, the test-only factory."""

    production = None

    def __new__(cls, *args):
        from a2a import _C

        return _C.testing_comm_create_mpi(STAGING, *args)

    @classmethod
    def from_nccl_id(cls, *args, **kwargs):
        return cls.production.from_nccl_id(*args, **kwargs)


def pytest_configure(config):
    if STAGING:
        from a2a import _C

        _StagedNativeComm.production = _C.Comm
        _C.Comm = _StagedNativeComm


def _comm_scope(fixture_name, config):
    # Under A2A_TEST_STAGING=predicted, and over torchrun's gloo group, a
    # disagreement in a call that the ranks predicted retires the comm
    # (docs/algorithms.md, "The predicted check"), as a timeout does
    # elsewhere: one comm per test, so that it spoils one test only.
    return "function" if STAGING == "predicted" or TORCHRUN else "module"


@pytest.fixture(scope=_comm_scope)
def comm(request):
    """COMM_WORLD, topology from A2A_LOCAL_SIZE or detected (under torchrun:
    its gloo group; tests/conftest.py). One per module, so that a comm
    retired by a failure (e.g. a timeout) spoils one module only."""
    import a2a

    return job_comm(request, a2a.Comm.from_mpi)


@pytest.fixture(scope="module")
def comm_copies(request):
    """Same topology, strided layouts packed with copies instead of MPI datatypes."""
    import a2a

    return job_comm(request, lambda world: a2a.Comm.from_mpi(world, use_mpi_datatypes=False))


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def need_two(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
