"""Comm.split on one process (a 1-rank communicator): the new communicator,
its collectives, the undefined color, the argument errors, and that a child
is made like its parent (settings, transports; seen on the debug channel).
The placement of ranks and the topology of children are tested under mpirun
(tests/mpi/test_mpi_split.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import reference as ref
from checks import raises_invalid

import a2a
from a2a import _C


def topology(c: a2a.Comm) -> tuple[int, ...]:
    return (c.rank, c.size, c.local_rank, c.local_size, c.node, c.num_nodes)


def check_collectives(c: a2a.Comm) -> None:
    for algo in ("linear", "2dh"):
        x = ref.a2a_input("split", 0, 1, (4, 3), "float32")
        ref.assert_bitwise_equal(a2a.all_to_all(x, comm=c, algo=algo), x, f"all_to_all {algo}")
        f = ref.flex_input("split", 0, 1, (2, 3, 5), 1, "int64")
        y = a2a.all_to_all_flex(f, comm=c, split_axis=1, concat_axis=0, algo=algo)
        ref.assert_bitwise_equal(y, ref.flex_expected("split", 0, 1, (2, 3, 5), 1, 0, "int64"), f"flex {algo}")
        v, counts = a2a.all_to_all_v(np.arange(6.0).reshape(3, 2), [3], comm=c, algo=algo)
        ref.assert_bitwise_equal(v, np.arange(6.0).reshape(3, 2), f"all_to_all_v {algo}")
        assert counts.tolist() == [3]
    d = np.arange(6, dtype=np.int32)
    ref.assert_bitwise_equal(a2a.all_gather(d, comm=c), d, "all_gather")
    ref.assert_bitwise_equal(a2a.all_reduce(d, comm=c, op="max"), d, "all_reduce")
    ref.assert_bitwise_equal(a2a.reduce_scatter(d, comm=c), d, "reduce_scatter")


def test_split_of_one_rank_is_a_comm_like_its_parent(comm):
    child = comm.split(0)
    assert isinstance(child, a2a.Comm) and child is not comm
    assert topology(child) == (0, 1, 0, 1, 0, 1)
    assert (child.device, child.transport, child.cuda_device) == ("cpu", "mpi", None)
    assert child.mpi_thread_level == comm.mpi_thread_level
    assert child.mpi_comm is None
    check_collectives(child)


@pytest.mark.parametrize("color,key", [(0, None), (5, -7), (2**31 - 1, 2**31 - 1), (np.int64(3), np.int32(-1))])
def test_any_color_and_key_in_range(comm, color, key):
    child = comm.split(color, key)
    assert topology(child) == (0, 1, 0, 1, 0, 1)


def test_undefined_color_gives_none(comm):
    assert comm.split(None) is None
    assert comm.split(None, key=3) is None
    assert comm._native.split(_C.UNDEFINED, 0) is None
    check_collectives(comm)  # the parent carries on


def test_undefined_is_mpi_undefined():
    mpi = pytest.importorskip("mpi4py.MPI")
    assert _C.UNDEFINED < 0
    if "Open MPI" in mpi.Get_library_version() or "MPICH" in mpi.Get_library_version():
        assert _C.UNDEFINED == mpi.UNDEFINED


@pytest.mark.parametrize(
    "color,key,fragments",
    [
        (1.0, None, ("color must be an int >= 0, or None", "got float 1.0")),
        ("0", None, ("color must be an int", "got str '0'")),
        (True, None, ("color must be an int", "got bool True")),
        (np.float32(2), None, ("color must be an int", "got float32")),
        (-1, None, ("color -1 is negative", "None for a rank that joins no new communicator")),
        (2**31, None, ("color 2147483648 does not fit in a C int",)),
        (0, "a", ("key must be an int, or None", "got str 'a'")),
        (0, -(2**31) - 1, ("key -2147483649 does not fit in a C int",)),
    ],
)
def test_bad_arguments_are_clear_errors(comm, color, key, fragments):
    raises_invalid(lambda: comm.split(color, key), "split on rank 0 of 1", *fragments)
    check_collectives(comm)  # nothing was left behind


def test_the_core_checks_the_color_too(comm):
    raises_invalid(lambda: comm._native.split(-3, 0), "split on rank 0 of 1", "color -3 is negative", "A2A_UNDEFINED")


def test_split_of_a_split(comm):
    grandchild = comm.split(1).split(0, key=4).split(2)
    assert topology(grandchild) == (0, 1, 0, 1, 0, 1)
    check_collectives(grandchild)


def test_a_child_outlives_its_parent(mpi):
    parent = a2a.Comm.from_mpi(mpi.COMM_SELF)
    child = parent.split(0)
    del parent
    gc.collect()
    check_collectives(child)


def test_children_are_independent(comm):
    first, second = comm.split(0), comm.split(0)
    check_collectives(first)
    del first
    gc.collect()
    check_collectives(second)
    check_collectives(comm)


def debug_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[a2a")]


@pytest.fixture
def debug_info(monkeypatch, mpi):
    """A2A_DEBUG=INFO for the test; afterwards a communicator made without it
    puts the process back to silent (the level is read at creation)."""
    monkeypatch.setenv("A2A_DEBUG", "INFO")
    yield
    monkeypatch.delenv("A2A_DEBUG")
    a2a.Comm.from_mpi(mpi.COMM_SELF)


def test_a_child_keeps_its_parents_settings(mpi, capfd, debug_info):
    parent = a2a.Comm.from_mpi(mpi.COMM_SELF, timeout_s=7)
    capfd.readouterr()
    parent.split(0)
    (line,) = debug_lines(capfd.readouterr().err)
    assert "INFO communicator created from a split: rank 0 of 1, 1 nodes x 1 ranks" in line, line
    assert "(local_size from the nodes of the communicator split)" in line, line
    assert "data transport mpi, control transport mpi, device cpu, timeout 7 s" in line, line
    assert line.endswith(", MPI_THREAD_MULTIPLE"), line


def test_the_timeout_given_at_creation_carries_to_a_split(mpi, capfd, debug_info):
    """Comm.timeout_s is what creation was given (None: A2A_TIMEOUT_S, else the default); the
    communicators a communicator makes wait as long as it does (split here; host_twin in
    tests/mpi/test_mpi_predicted.py, where a twin is a new communicator)."""
    assert a2a.Comm.from_mpi(mpi.COMM_SELF).timeout_s is None
    parent = a2a.Comm.from_mpi(mpi.COMM_SELF, timeout_s=7)
    capfd.readouterr()
    child = parent.split(0)
    assert parent.timeout_s == 7 and child.timeout_s == 7
    (line,) = debug_lines(capfd.readouterr().err)
    assert "timeout 7 s" in line, line


@pytest.mark.parametrize(
    "staging,transports",
    [
        ("staged", "data transport mpi-staged, control transport mpi"),
        ("control", "data transport mpi, control transport control-over-device"),
    ],
)
def test_a_child_keeps_its_parents_transports(mpi, capfd, debug_info, staging, transports):
    """The test-only arrangements of the CUDA communicators' transports over
    host memory (setup/testing_comm.hpp) carry over to children and their
    children, as transport="mpi" with device="cuda" and NCCL-only ones do."""
    native = _C.testing_comm_create_mpi(staging, mpi._addressof(mpi.COMM_SELF), 0, 9.0, -1, 0, 0, -1, -1)
    parent = a2a.Comm(native)
    capfd.readouterr()
    child = parent.split(0)
    grandchild = child.split(0)
    lines = debug_lines(capfd.readouterr().err)
    assert len(lines) == 2, lines
    for line in lines:
        assert f"{transports}, device cpu, timeout 9 s" in line, line
    check_collectives(grandchild)
