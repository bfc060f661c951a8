"""Fixtures for the Tutel surface's tests under mpirun (tests/run_mpi.py's
tutel-* configurations). Every rank runs the same tests in the same order."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def comm(world):
    import a2a

    return a2a.Comm.from_mpi(world)
