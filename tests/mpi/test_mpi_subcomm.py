"""Communicators over mpi4py sub-communicators (comm.Split), interleaved with
the world communicator."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_2dh_rejected, check_bad_rank, outcome, regular

import a2a

SPLITS = {
    "parity": lambda rank, size: rank % 2,
    "halves": lambda rank, size: int(rank >= size // 2),
    "all-but-last": lambda rank, size: int(rank == size - 1),
    "reversed": lambda rank, size: 0,  # one group, keys reverse the order
}


@pytest.fixture(params=list(SPLITS))
def sub(request, world):
    rank, size = world.Get_rank(), world.Get_size()
    color = SPLITS[request.param](rank, size)
    key = size - rank if request.param == "reversed" else rank
    mpi_sub = world.Split(color, key)
    try:
        yield mpi_sub, color, a2a.Comm.from_mpi(mpi_sub)
    finally:
        mpi_sub.Free()


def test_sub_topology(sub):
    mpi_sub, _, c = sub
    assert c.size == mpi_sub.Get_size()
    assert c.rank == mpi_sub.Get_rank()
    assert c.rank == c.node * c.local_size + c.local_rank


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_sub_collectives(comm, sub, algo):
    _, color, c = sub
    # Groups may differ in size and regularity, so what a rank does on its
    # sub-communicator depends on its group: world collectives come first and
    # every check waits until the end, so that no group can leave the others
    # waiting.
    wshape = (comm.size * 2,)
    wx = ref.a2a_input("world-before", comm.rank, comm.size, wshape, "int32")
    world_result = a2a.all_to_all(wx, comm=comm)

    tag = f"sub{color}"
    shape, fshape = (c.size * 3, 5), (2, c.size * 2, 3)
    counts = ref.v_counts("varied", c.size)
    x = ref.a2a_input(tag, c.rank, c.size, shape, "float64")
    fx = ref.flex_input(tag, c.rank, c.size, fshape, 1, "float16")
    vx = ref.v_input(tag, c.rank, counts, (2,), "int64")
    results = {
        "a2a": outcome(lambda: a2a.all_to_all(x, comm=c, algo=algo)),
        "flex": outcome(lambda: a2a.all_to_all_flex(fx, comm=c, split_axis=1, concat_axis=2, algo=algo)),
        "v": outcome(lambda: a2a.all_to_all_v(vx, counts[c.rank], comm=c, algo=algo)),
    }

    wexpected = ref.a2a_expected("world-before", comm.rank, comm.size, wshape, "int32")
    ref.assert_bitwise_equal(world_result, wexpected, "world a2a")
    if algo == "2dh" and not regular(c):
        for _, error in results.values():
            check_2dh_rejected(error)
        return
    for name, (_, error) in results.items():
        assert error is None, f"{name} on the sub-communicator: {error!r}"
    ref.assert_bitwise_equal(results["a2a"][0], ref.a2a_expected(tag, c.rank, c.size, shape, "float64"), "sub a2a")
    ref.assert_bitwise_equal(
        results["flex"][0], ref.flex_expected(tag, c.rank, c.size, fshape, 1, 2, "float16"), "sub flex"
    )
    y, recv_counts = results["v"][0]
    expected, expected_counts = ref.v_expected(tag, c.rank, counts, (2,), "int64")
    ref.assert_bitwise_equal(y, expected, "sub v")
    assert recv_counts.tolist() == expected_counts.tolist()


def test_sub_bad_input_stays_in_the_sub_communicator(comm, sub):
    """An error inside one group is reported in that group only; the world
    communicator carries on."""
    _, _, c = sub
    bad = c.size - 1
    x = np.zeros((c.size * 2, 3), object if c.rank == bad else np.float32)
    error = outcome(lambda: a2a.all_to_all(x, comm=c))[1]
    wx = ref.a2a_input("world-after", comm.rank, comm.size, (comm.size,), "float32")
    world_result = a2a.all_to_all(wx, comm=comm)
    check_bad_rank(c, bad, "all_to_all", error, "object")
    ref.assert_bitwise_equal(
        world_result, ref.a2a_expected("world-after", comm.rank, comm.size, (comm.size,), "float32")
    )
