"""The check inside the algorithms' own messages (docs/algorithms.md, "The
argument check"): on MPI communicators 2DH's two exchanges, flex, v and
all_gather and the reductions carry the cross-rank check, so a rank in another call, or with
other arguments, may send in another pattern than its peers (node then rail,
or the whole world) and every rank still raises, nobody waits for a message
that never comes, and no message of the failed call is left behind for the
next one (each case ends with a correct collective, then a second one of
another kind, on the same comm).

One rank (the odd one: the first, the last, or one on another node and
another rail than rank 0) calls something else than the others.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome, regular

import a2a

ODD = ["first", "last", "across"]


def odd_rank(comm, which):
    if which == "first":
        return 0
    if which == "last":
        return comm.size - 1
    # node 1, local rank 1 where there is one: shares neither node nor rail with rank 0
    return min(comm.size - 1, comm.local_size + 1)


@pytest.fixture
def two(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
    if not regular(comm):
        pytest.skip("2dh is rejected outright on this topology")


def x_for(comm, rows_per_peer=2, dtype="float32", name="in-band"):
    return ref.a2a_input(name, comm.rank, comm.size, (comm.size * rows_per_peer, 3), dtype)


def works_twice(comm):
    """Two correct collectives of different patterns (2DH, then a linear one
    over the world): a message of the failed call left anywhere would be
    taken by one of them. Returns the check to run at the end."""
    shape = (comm.size * 3, 2)
    x = ref.a2a_input("after", comm.rank, comm.size, shape, "float32")
    expected = ref.a2a_expected("after", comm.rank, comm.size, shape, "float32")
    results = [outcome(lambda algo=algo: a2a.all_to_all(x, comm=comm, algo=algo)) for algo in ("2dh", "linear")]

    def check():
        for algo, (result, error) in zip(("2dh", "linear"), results):
            assert error is None, f"{algo} after the error: {error!r}"
            ref.assert_bitwise_equal(result, expected, f"{algo} after the error")

    return check


def mismatch_everywhere(comm, call, *fragments):
    error = outcome(call)[1]
    after = works_twice(comm)
    check_mismatch(error, *fragments)
    after()


def all_to_all(comm, rows_per_peer=2, algo="2dh"):
    x = x_for(comm, rows_per_peer)
    return lambda: a2a.all_to_all(x, comm=comm, algo=algo)


@pytest.mark.parametrize("which", ODD)
def test_2dh_count_differs(comm, two, which):
    odd = odd_rank(comm, which)
    rows = 3 if comm.rank == odd else 2
    mismatch_everywhere(comm, all_to_all(comm, rows), "all_to_all", "'count per peer' differs",
                        f"rank {odd}: 9", f"rank {(odd + 1) % comm.size}: 6")


@pytest.mark.parametrize("sizes", [(3, 50_000), (50_000, 3)], ids=["small-large", "large-small"])
def test_2dh_counts_of_any_sizes(comm, two, sizes):
    """Rendezvous messages (past Open MPI's eager limit) in either direction:
    a sender's large message is taken by its receiver's settle."""
    odd = comm.size - 1
    rows = sizes[0] if comm.rank == odd else sizes[1]
    x = np.zeros(comm.size * rows, np.float32)
    mismatch_everywhere(comm, lambda: a2a.all_to_all(x, comm=comm, algo="2dh"), "'count per peer' differs")


def test_three_different_counts(comm, two):
    if comm.size < 3:
        pytest.skip("needs 3 ranks")
    rows = {0: 2, comm.size - 1: 4}.get(comm.rank, 3)
    mismatch_everywhere(comm, all_to_all(comm, rows), "'count per peer' differs")


@pytest.mark.parametrize("which", ODD)
def test_2dh_against_linear(comm, two, which):
    """The odd rank exchanges over the world, the others inside nodes, then
    along rails."""
    odd = odd_rank(comm, which)
    algo = "linear" if comm.rank == odd else "2dh"
    mismatch_everywhere(comm, all_to_all(comm, algo=algo), "'algo' differs", f"rank {odd}: linear")


@pytest.mark.parametrize("which", ODD)
@pytest.mark.parametrize("other", ["all_reduce", "all_gather", "all_to_all_v", "plan_v", "flex", "route"])
def test_2dh_against_another_collective(comm, two, which, other):
    odd = odd_rank(comm, which)
    x = x_for(comm)
    others = {
        "all_reduce": lambda: a2a.all_reduce(x, comm=comm),  # its reduce-scatter exchange over the world
        "all_gather": lambda: a2a.all_gather(x, comm=comm),  # the data over the world
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [2] * comm.size, comm=comm),  # sizes probed (one round)
        "plan_v": lambda: a2a.plan_v([2] * comm.size, like=x, comm=comm),  # counts over the world
        "flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, algo="2dh"),
        "route": lambda: a2a.route(np.zeros((4, 1), np.int64), num_experts=2, capacity=4, comm=comm),
    }
    name = {"plan_v": "all_to_all_v (count exchange)", "flex": "all_to_all_flex"}.get(other, other)
    call = others[other] if comm.rank == odd else all_to_all(comm)
    mismatch_everywhere(comm, call, "ranks called different collectives", f"rank {odd}: {name}")


@pytest.mark.parametrize("which", ODD)
def test_2dh_v_against_2dh(comm, two, which):
    """A planned uneven 2DH (its counts over the world, then its relay inside
    nodes, then its data in two phases) against a uniform one."""
    odd = odd_rank(comm, which)
    x = x_for(comm)
    if comm.rank == odd:
        call = lambda: a2a.all_to_all_v(x, [2] * comm.size, comm=comm, algo="2dh")
    else:
        call = all_to_all(comm)
    mismatch_everywhere(comm, call, "ranks called different collectives")


def test_different_2dh_plans(comm, two):
    """The data phases of two plans: each rank runs a plan of its own."""
    x = np.zeros((comm.size, 2), np.float32)
    first = a2a.plan_v([1] * comm.size, like=x, comm=comm, algo="2dh")
    second = a2a.plan_v([1] * comm.size, like=x, comm=comm, algo="2dh")
    plan = first if comm.rank == comm.size - 1 else second
    mismatch_everywhere(comm, lambda: plan.run(x), "all_to_all_v", "'plan' differs")


@pytest.mark.parametrize("which", ODD)
def test_2dh_flex_shape_differs(comm, two, which):
    odd = odd_rank(comm, which)
    x = np.zeros((comm.size * 2, 4 if comm.rank == odd else 3, 2), np.float32)
    mismatch_everywhere(comm, lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, algo="2dh"),
                        "'shape[1]' differs")


@pytest.mark.parametrize("which", ODD)
def test_2dh_bad_input_on_one_rank(comm, two, which):
    """The rank with the bad input sends nothing but its notices."""
    odd = odd_rank(comm, which)
    x = x_for(comm).astype(object) if comm.rank == odd else x_for(comm)
    error = outcome(lambda: a2a.all_to_all(x, comm=comm, algo="2dh"))[1]
    after = works_twice(comm)
    check_bad_rank(comm, odd, "all_to_all", error, "object")
    after()


def test_2dh_bad_input_on_every_rank(comm, two):
    x = x_for(comm).astype(object)
    error = outcome(lambda: a2a.all_to_all(x, comm=comm, algo="2dh"))[1]
    after = works_twice(comm)
    assert isinstance(error, a2a.InvalidArgumentError), repr(error)
    after()


def test_all_gather_dtype_differs(comm, two):
    x = np.zeros(3, np.float32 if comm.rank == 0 else np.float64)
    mismatch_everywhere(comm, lambda: a2a.all_gather(x, comm=comm), "all_gather", "'dtype' differs")


def test_all_gather_v_counts_differ(comm, two):
    """all_gather_v carries the digest of its counts in band; a difference is
    explained by entry, as by round."""
    counts = [1] * comm.size
    if comm.rank == comm.size - 1:
        counts[0] = 2
    x = np.zeros(counts[comm.rank], np.float32)
    mismatch_everywhere(comm, lambda: a2a.all_gather_v(x, counts, comm=comm), "'counts' differ across ranks",
                        "counts[0] = 2")


@pytest.mark.parametrize("which", ODD)
def test_all_reduce_count_differs(comm, two, which):
    """all_reduce's pieces follow from its count: a rank with another count
    would send pieces of other sizes, and its labels differ instead."""
    odd = odd_rank(comm, which)
    x = np.ones(9 if comm.rank == odd else 8, np.float32)
    mismatch_everywhere(comm, lambda: a2a.all_reduce(x, comm=comm), "all_reduce", "'count' differs", f"rank {odd}: 9")


@pytest.mark.parametrize("which", ODD)
def test_reduce_scatter_against_all_reduce(comm, two, which):
    """Both start with an exchange of the same sizes (one block of 2 per rank),
    told apart by their labels."""
    odd = odd_rank(comm, which)
    x = np.ones(2 * comm.size, np.float32)
    call = (lambda: a2a.reduce_scatter(x, comm=comm)) if comm.rank == odd else lambda: a2a.all_reduce(x, comm=comm)
    mismatch_everywhere(comm, call, "ranks called different collectives", f"rank {odd}: reduce_scatter")


def test_reduce_scatter_v_counts_differ(comm, two):
    counts = [2] * comm.size
    if comm.rank == comm.size - 1:
        counts[1] = 3
    x = np.ones(sum(counts), np.float32)
    mismatch_everywhere(comm, lambda: a2a.reduce_scatter_v(x, counts, comm=comm), "'counts' differ across ranks",
                        "counts[1] = 3")


def test_reductions_of_odd_counts_in_place(comm, two):
    """Counts below, at and above the world size, so that some pieces are
    empty and the first count % W are one longer; in place and out of place;
    the float32 sums (rounded differently in another order) equal on every
    rank, bit for bit: each piece is reduced by one rank."""

    def inputs(tag, count, dtype):
        return [np.random.default_rng([count, r, len(tag)]).standard_normal(count).astype(dtype)
                for r in range(comm.size)]

    for count in (1, comm.size - 1, comm.size, 3 * comm.size + 1):
        values = inputs("max", count, np.float16)
        x = values[comm.rank].copy()
        assert a2a.all_reduce(x, comm=comm, out=x, op="max") is x
        np.testing.assert_array_equal(x, np.max(np.stack(values), axis=0))
        summed = a2a.all_reduce(inputs("sum", count, np.float32)[comm.rank], comm=comm)
        every = a2a.all_gather(summed, comm=comm).reshape(comm.size, count)
        assert (every.view(np.uint32) == summed.view(np.uint32)).all(), every
        np.testing.assert_allclose(summed, np.sum(np.stack(inputs("sum", count, np.float64)), axis=0),
                                   rtol=1e-5, atol=1e-5)
        rows = inputs("rows", comm.size * count, np.float64)
        got = a2a.reduce_scatter(rows[comm.rank], comm=comm)
        np.testing.assert_allclose(got, np.sum(np.stack(rows), axis=0)[comm.rank * count : (comm.rank + 1) * count],
                                   rtol=1e-12)
