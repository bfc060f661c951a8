"""The communicator's topology under mpirun: detected, or emulated with
A2A_LOCAL_SIZE / local_size=."""

from __future__ import annotations

import os

import numpy as np
import reference as ref
from a2a_mpi_util import check_2dh_rejected, expect_2dh_rejected, outcome, regular

import a2a


def test_rank_and_size_match_mpi(comm, world):
    assert comm.rank == world.Get_rank()
    assert comm.size == world.Get_size()


def test_nodes_are_blocks_of_consecutive_ranks(comm):
    assert comm.rank == comm.node * comm.local_size + comm.local_rank
    assert 0 <= comm.local_rank < comm.local_size
    assert 0 <= comm.node < comm.num_nodes
    if regular(comm):
        assert comm.num_nodes * comm.local_size == comm.size


def test_local_size_comes_from_env_or_detection(comm, world):
    from mpi4py import MPI

    env = os.environ.get("A2A_LOCAL_SIZE")
    if env:
        assert comm.local_size == int(env)
    else:
        node = world.Split_type(MPI.COMM_TYPE_SHARED, world.Get_rank())
        try:
            assert comm.local_size == node.Get_size()
        finally:
            node.Free()


def test_every_rank_sees_the_same_topology(comm, world):
    mine = (comm.rank, comm.size, comm.local_rank, comm.local_size, comm.node, comm.num_nodes)
    everyone = world.allgather(mine)
    for r, (rank, size, local_rank, local_size, node, num_nodes) in enumerate(everyone):
        assert rank == r
        assert (size, local_size, num_nodes) == (comm.size, comm.local_size, comm.num_nodes)
        assert (node, local_rank) == divmod(r, local_size)


def test_local_size_argument_overrides_env(world):
    c = a2a.Comm.from_mpi(world, local_size=1)
    x = ref.a2a_input("t1", c.rank, c.size, (c.size * 3,), "int32")
    y = a2a.all_to_all(x, comm=c, algo="2dh")
    assert (c.local_size, c.num_nodes, c.node, c.local_rank) == (1, world.Get_size(), world.Get_rank(), 0)
    ref.assert_bitwise_equal(y, ref.a2a_expected("t1", c.rank, c.size, (c.size * 3,), "int32"))


def test_irregular_local_size_rejects_2dh_on_every_rank(world):
    """local_size = size + 1 never divides the world: 2DH is refused with the
    reason on every rank (nobody hangs) and linear still works."""
    size = world.Get_size()
    c = a2a.Comm.from_mpi(world, local_size=size + 1)
    assert c.local_size == size + 1
    x = ref.a2a_input("irr", c.rank, size, (size * 2, 3), "float32")
    expected = ref.a2a_expected("irr", c.rank, size, (size * 2, 3), "float32")
    errors = [
        outcome(lambda: a2a.all_to_all(x, comm=c, algo="2dh"))[1],
        outcome(lambda: a2a.all_to_all_flex(x, comm=c, split_axis=0, concat_axis=1, algo="2dh"))[1],
        outcome(lambda: a2a.all_to_all_v(x, [2] * size, comm=c, algo="2dh"))[1],
    ]
    linear = a2a.all_to_all(x, comm=c, algo="linear")
    for error in errors:
        check_2dh_rejected(error)
    ref.assert_bitwise_equal(linear, expected)


def test_env_local_size_rejecting_2dh(comm):
    """The np=3 / A2A_LOCAL_SIZE=2 configuration of run_mpi.py lands here."""
    if regular(comm):
        return
    x = np.zeros(comm.size * 2, np.float32)
    expect_2dh_rejected(lambda: a2a.all_to_all(x, comm=comm, algo="2dh"))


def test_local_size_that_differs_across_ranks_is_a_mismatch(world):
    size = world.Get_size()
    if size < 2:
        return
    mine = 1 if world.Get_rank() == 0 else 2
    try:
        a2a.Comm.from_mpi(world, local_size=mine)
    except a2a.MismatchError as error:
        message = str(error)
        assert "local_size differs across ranks" in message, message
        assert f"rank {world.Get_rank()}" in message, message
        assert f"this rank has {mine}" in message, message
    else:
        raise AssertionError("different local_size values on different ranks were accepted")


def test_an_mpi_error_in_topology_detection_is_a_transport_error(world, need_two):
    # Detection on an intercommunicator fails inside MPI (where depends on
    # the MPI: Open MPI refuses the node allreduce). Every MPI call of
    # creation is checked: a TransportError naming the step, the call and the
    # rank, not garbage topology or a crash.
    color = world.Get_rank() % 2
    local = world.Split(color, world.Get_rank())
    inter = local.Create_intercomm(0, world, 1 - color, tag=7)
    _, error = outcome(lambda: a2a.Comm.from_mpi(inter, timeout_s=30))
    rank = inter.Get_rank()
    inter.Free()
    local.Free()
    assert isinstance(error, a2a.TransportError), repr(error)
    message = str(error)
    assert f"rank {rank}: " in message, message
    assert "failed: " in message and "MPI_" in message, message
    assert "topology detection" in message or "communicator creation" in message, message
