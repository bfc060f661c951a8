"""Fixtures for the runtime's tests under mpirun (tests/run_mpi.py's moe-*
configurations, and gpu-moe-* on CUDA: runtime_util.DEVICE). Every rank
runs the same tests in the same order."""

from __future__ import annotations

import os
import sys

import pytest
from launcher import job_comm

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def comm(request):
    from runtime_util import suite_comm  # on the device A2A_TEST_DEVICE names (runtime_util)

    return job_comm(request, suite_comm)  # under torchrun: its gloo group (tests/conftest.py)
