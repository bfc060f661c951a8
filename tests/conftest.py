"""Shared by every test folder: makes tests/reference.py importable, and
gives the mpirun suites (tests/mpi, mpi_runtime, mpi_tutel) the MPI world."""

from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(scope="session")
def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD
