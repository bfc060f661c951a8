"""Shared by every test folder: makes tests/reference.py importable, and
gives the mpirun suites (tests/mpi, mpi_runtime, mpi_tutel) the MPI world.

Under A2A_TEST_LAUNCHER=torchrun (tests/run_mpi.py's torchrun-*
configurations) the ranks are torchrun's, over a gloo group and with no MPI
beneath: the suites' communicators are a2a.Comm.from_torch(device="cpu")
(launcher.job_comm), and a test that uses MPI itself (the `world` fixture) is
skipped."""

from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from launcher import TORCHRUN  # after the path above


def pytest_configure(config):
    if TORCHRUN:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")


@pytest.fixture(scope="session")
def world():
    if TORCHRUN:
        pytest.skip("uses MPI itself; under torchrun there is none")
    from mpi4py import MPI

    return MPI.COMM_WORLD
