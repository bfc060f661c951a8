"""Calls from several threads (csrc/core/call_guard.hpp): two threads on one
communicator always fail clearly; on two communicators they run at once under
MPI_THREAD_MULTIPLE and fail clearly with less.

tests/run_mpi.py runs these in their own configurations (A2A_TEST_THREADS=1):
threads-np2 with mpi4py's default MPI_THREAD_MULTIPLE, threads-serialized with
mpi4py.rc.thread_level = "serialized" (A2A_TEST_MPI_THREAD_LEVEL, set by
_rank_pytest.py before MPI starts). Rank 0 makes the overlapping call while
its other thread waits inside a collective for the other ranks, which join
late: the overlap is certain, not a race. As in the timeout tests, each
scenario runs once in a module fixture that records outcomes, and the tests
only inspect them.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import reference as ref

import a2a

pytestmark = pytest.mark.skipif(
    os.environ.get("A2A_TEST_THREADS") != "1", reason="run by tests/run_mpi.py in a dedicated mpirun"
)

EXPECTED_LEVEL = os.environ.get("A2A_TEST_MPI_THREAD_LEVEL") or "multiple"
# Rank 0's second call starts this long after its first; the other ranks join
# the first only after JOIN_LATE_S.
OVERLAP_S, JOIN_LATE_S = 0.5, 2.0


def attempt(call):
    try:
        return call(), None
    except a2a.A2AError as error:
        return None, error


def in_thread(call):
    """Starts call() on a thread; the returned join() gives its attempt()."""
    box = []
    thread = threading.Thread(target=lambda: box.append(attempt(call)))
    thread.start()
    return lambda: (thread.join(), box[0])[1]


def all_to_all_case(comm, tag):
    shape = (comm.size * 3,)
    x = ref.a2a_input(tag, comm.rank, comm.size, shape, "int64")
    return x, ref.a2a_expected(tag, comm.rank, comm.size, shape, "int64")


@pytest.fixture(scope="module")
def same_comm(world):
    """Rank 0: an all_gather on the communicator that its other thread is
    inside (all_to_all, waiting for the late ranks)."""
    if world.Get_size() < 2:
        pytest.skip("needs at least 2 ranks")
    comm = a2a.Comm.from_mpi(world)
    x, expected = all_to_all_case(comm, "same")
    record = {"expected": expected}
    world.Barrier()
    if comm.rank == 0:
        join = in_thread(lambda: a2a.all_to_all(x, comm=comm))
        time.sleep(OVERLAP_S)
        record["second"] = attempt(lambda: a2a.all_gather(np.arange(4), comm=comm))
        record["first"] = join()
    else:
        time.sleep(JOIN_LATE_S)
        record["first"] = attempt(lambda: a2a.all_to_all(x, comm=comm))
    world.Barrier()
    record["after"] = attempt(lambda: a2a.all_to_all(x, comm=comm))  # still usable
    return comm, record


@pytest.fixture(scope="module")
def two_comms(world):
    """Rank 0: an all_to_all on a second communicator while its other thread
    is inside one on the first (waiting for the late ranks). Under
    MPI_THREAD_MULTIPLE the late ranks take part in the second first."""
    if world.Get_size() < 2:
        pytest.skip("needs at least 2 ranks")
    first, second = a2a.Comm.from_mpi(world), a2a.Comm.from_mpi(world)
    multiple = first.mpi_thread_level == "multiple"  # the same on every rank
    x, expected = all_to_all_case(first, "two")
    record = {"expected": expected, "multiple": multiple}
    world.Barrier()
    if first.rank == 0:
        join = in_thread(lambda: a2a.all_to_all(x, comm=first))
        time.sleep(OVERLAP_S)
        record["second"] = attempt(lambda: a2a.all_to_all(x, comm=second))
        record["first"] = join()
    else:
        if multiple:
            record["second"] = attempt(lambda: a2a.all_to_all(x, comm=second))
        time.sleep(JOIN_LATE_S)
        record["first"] = attempt(lambda: a2a.all_to_all(x, comm=first))
    world.Barrier()
    return first, record


def test_the_comm_reports_the_granted_thread_level(world):
    from mpi4py import MPI

    comm = a2a.Comm.from_mpi(world)
    names = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
    }
    assert comm.mpi_thread_level == names.get(MPI.Query_thread(), "multiple") == EXPECTED_LEVEL


def test_a_second_thread_on_the_same_comm_fails_clearly(same_comm):
    comm, record = same_comm
    if comm.rank != 0:
        pytest.skip("rank 0 makes the overlapping call")
    _, error = record["second"]
    assert isinstance(error, a2a.UnsupportedError), repr(error)
    message = str(error)
    for fragment in (
        "all_gather on rank 0",
        "another thread is inside all_to_all on this communicator",
        "overlap",
    ):
        assert fragment in message, message


def test_the_call_inside_is_unharmed(same_comm):
    _, record = same_comm
    result, error = record["first"]
    assert error is None, repr(error)
    ref.assert_bitwise_equal(result, record["expected"])
    result, error = record["after"]
    assert error is None, repr(error)
    ref.assert_bitwise_equal(result, record["expected"])


def test_two_comms_from_two_threads(two_comms):
    _, record = two_comms
    result, error = record["first"]
    assert error is None, repr(error)
    ref.assert_bitwise_equal(result, record["expected"])
    if "second" not in record:
        return  # a late rank without MPI_THREAD_MULTIPLE: it never calls the second
    result, error = record["second"]
    if record["multiple"]:
        assert error is None, repr(error)
        ref.assert_bitwise_equal(result, record["expected"])
    else:
        assert isinstance(error, a2a.UnsupportedError), repr(error)
        message = str(error)
        for fragment in ("all_to_all on rank 0", "MPI_THREAD_SERIALIZED", "need MPI_THREAD_MULTIPLE"):
            assert fragment in message, message
