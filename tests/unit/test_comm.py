"""a2a.Comm on one process: construction, options, topology."""

from __future__ import annotations

import numpy as np
import pytest
from reference import assert_bitwise_equal

import a2a


def test_comm_self_topology(comm):
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size, comm.node, comm.num_nodes) == (0, 1, 0, 1, 0, 1)


def test_default_is_comm_world(mpi):
    c = a2a.Comm.from_mpi()
    assert c.size == mpi.COMM_WORLD.Get_size()
    assert c.rank == mpi.COMM_WORLD.Get_rank()
    assert c.mpi_comm is mpi.COMM_WORLD


def test_repr_names_the_topology(comm):
    text = repr(comm)
    for part in ("rank=0", "size=1", "local_rank=0", "local_size=1", "node=0", "num_nodes=1"):
        assert part in text


def test_local_size_argument_emulates_nodes(mpi):
    # 1 rank with local_size=1: one node of one rank.
    c = a2a.Comm.from_mpi(mpi.COMM_SELF, local_size=1)
    assert (c.local_size, c.num_nodes, c.node, c.local_rank) == (1, 1, 0, 0)


def test_env_local_size(monkeypatch, mpi):
    monkeypatch.setenv("A2A_LOCAL_SIZE", "1")
    c = a2a.Comm.from_mpi(mpi.COMM_SELF)
    assert c.local_size == 1 and c.num_nodes == 1


@pytest.mark.parametrize("value", ["abc", "-2", "1.5"])
def test_bad_env_local_size_is_rejected(monkeypatch, mpi, value):
    monkeypatch.setenv("A2A_LOCAL_SIZE", value)
    with pytest.raises(a2a.InvalidArgumentError, match="A2A_LOCAL_SIZE"):
        a2a.Comm.from_mpi(mpi.COMM_SELF)


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_bad_env_timeout_is_rejected(monkeypatch, mpi, value):
    monkeypatch.setenv("A2A_TIMEOUT_S", value)
    with pytest.raises(a2a.InvalidArgumentError, match="A2A_TIMEOUT_S"):
        a2a.Comm.from_mpi(mpi.COMM_SELF)


def test_timeout_argument_overrides_a_bad_env(monkeypatch, mpi):
    monkeypatch.setenv("A2A_TIMEOUT_S", "abc")
    a2a.Comm.from_mpi(mpi.COMM_SELF, timeout_s=5)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), True, "5"])
def test_a_timeout_argument_is_seconds_above_zero(mpi, timeout_s):
    with pytest.raises(ValueError, match=r"timeout_s must be None .* or a number of seconds > 0, got "):
        a2a.Comm.from_mpi(mpi.COMM_SELF, timeout_s=timeout_s)


@pytest.mark.parametrize("local_size", [0, -1])
def test_bad_local_size_argument(mpi, local_size):
    with pytest.raises(ValueError, match="local_size"):
        a2a.Comm.from_mpi(mpi.COMM_SELF, local_size=local_size)


@pytest.mark.parametrize("bad", [3, "COMM_WORLD", object()])
def test_comm_must_be_an_mpi4py_communicator(bad):
    with pytest.raises(TypeError, match="mpi4py communicator"):
        a2a.Comm.from_mpi(bad)


def test_comm_null_is_rejected(mpi):
    with pytest.raises(ValueError, match="COMM_NULL"):
        a2a.Comm.from_mpi(mpi.COMM_NULL)


def test_collectives_require_an_a2a_comm(mpi):
    x = np.zeros(4, np.float32)
    for call in (
        lambda: a2a.all_to_all(x, comm=mpi.COMM_SELF),
        lambda: a2a.all_to_all_flex(x, comm=None, split_axis=0, concat_axis=0),
        lambda: a2a.all_to_all_v(x, [4], comm="world"),
    ):
        with pytest.raises(TypeError, match="a2a.Comm"):
            call()


def test_sub_communicator_of_comm_self(mpi):
    sub = mpi.COMM_SELF.Split(0, 0)
    try:
        c = a2a.Comm.from_mpi(sub)
        x = np.arange(6, dtype=np.int64)
        assert_bitwise_equal(a2a.all_to_all(x, comm=c), x)
    finally:
        sub.Free()


def test_comm_survives_freeing_the_mpi_communicator(mpi):
    """The MPI communicator is duplicated, so the caller may free theirs."""
    sub = mpi.COMM_SELF.Dup()
    c = a2a.Comm.from_mpi(sub)
    sub.Free()
    x = np.arange(5, dtype=np.float64)
    assert_bitwise_equal(a2a.all_to_all(x, comm=c), x)


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_flex", "all_to_all_v"])
def test_2dh_on_irregular_nodes_is_rejected_but_linear_works(mpi, op):
    """local_size=2 on a 1-rank communicator: nodes are not equal blocks."""
    c = a2a.Comm.from_mpi(mpi.COMM_SELF, local_size=2)
    x = np.arange(4, dtype=np.float32)

    def call(algo):
        if op == "all_to_all":
            return a2a.all_to_all(x, comm=c, algo=algo)
        if op == "all_to_all_flex":
            return a2a.all_to_all_flex(x, comm=c, split_axis=0, concat_axis=0, algo=algo)
        return a2a.all_to_all_v(x, [4], comm=c, algo=algo)[0]

    with pytest.raises(a2a.InvalidArgumentError) as info:
        call("2dh")
    message = str(info.value)
    assert "2dh" in message
    assert "not divisible by local_size 2" in message
    assert "rank 0" in message
    assert_bitwise_equal(call("linear"), x)


@pytest.mark.parametrize("datatypes", [True, False, None])
def test_use_mpi_datatypes_option(mpi, datatypes):
    c = a2a.Comm.from_mpi(mpi.COMM_SELF, use_mpi_datatypes=datatypes)
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    assert_bitwise_equal(a2a.all_to_all_flex(x, comm=c, split_axis=2, concat_axis=1), x)


def test_workspace_is_cached_and_grows(comm):
    a, n = comm.workspace(0)
    assert (a, n) == (0, 0)
    a1, n1 = comm.workspace(100)
    assert n1 >= 100
    a2, n2 = comm.workspace(50)
    assert (a2, n2) == (a1, n1)
    _, n3 = comm.workspace(1000)
    assert n3 >= 1000


def test_a_regular_communicator_has_no_irregular_reason():
    from mpi4py import MPI

    comm = a2a.Comm.from_mpi(MPI.COMM_WORLD)
    assert comm.irregular_reason == ""
