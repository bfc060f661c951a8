"""Comm.split under mpirun: who lands where (rank, size and the topology
derived from the parent's nodes), the collectives on the new communicators
against NumPy (2DH included, on children whose nodes are regular), several
children used interleaved with their parent, splits of splits, a child that
outlives its parent, and the errors, raised on every rank.

Ranks in different children run different amounts of work on them, so each
test runs everything first and asserts at the end (tests/mpi/a2a_mpi_util.py).
"""

from __future__ import annotations

import gc
from collections import defaultdict
from functools import partial

import numpy as np
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome

import a2a

# name -> (color, key) of world rank r of n whose node is `node` and
# local rank `local`; color None joins no child.
SPLITS = {
    "parity": lambda r, n, node, local: (r % 2, r),
    "halves": lambda r, n, node, local: (int(r >= n // 2), r),
    "reversed": lambda r, n, node, local: (0, n - r),
    "key-ties": lambda r, n, node, local: (0, r % 2),  # evens first, then odds; ties by rank
    "nodes": lambda r, n, node, local: (node, r),
    "rails": lambda r, n, node, local: (local, -r),  # one rank of every node, in reverse
    "some-undefined": lambda r, n, node, local: (None if r % 3 == 1 else r % 2, r),
    "only-last": lambda r, n, node, local: (7 if r == n - 1 else None, r),
}


def world_entries(comm: a2a.Comm, plan) -> list[tuple]:
    """(color, key, node) of every rank of comm under plan(r, n, node, local)."""
    entries = []
    for r in range(comm.size):
        node, local = divmod(r, comm.local_size)
        color, key = plan(r, comm.size, node, local)
        entries.append((color, key, node))
    return entries


def expected_child(entries: list[tuple], rank: int) -> tuple[int, ...] | None:
    """(rank, size, local_rank, local_size, node, num_nodes) of `rank`'s child,
    or None: the ranks of its color by (key, rank); local_size is the number
    of child ranks per parent node when each node's child ranks are
    consecutive and all nodes have as many, else 1."""
    color = entries[rank][0]
    if color is None:
        return None
    members = sorted(
        (r for r in range(len(entries)) if entries[r][0] == color), key=lambda r: (entries[r][1], r)
    )
    positions = defaultdict(list)
    for position, r in enumerate(members):
        positions[entries[r][2]].append(position)
    consecutive = all(p == list(range(p[0], p[0] + len(p))) for p in positions.values())
    counts = {len(p) for p in positions.values()}
    local_size = counts.pop() if consecutive and len(counts) == 1 else 1
    size, new_rank = len(members), members.index(rank)
    return (new_rank, size, new_rank % local_size, local_size, new_rank // local_size, size // local_size)


def topology(c: a2a.Comm | None) -> tuple[int, ...] | None:
    return None if c is None else (c.rank, c.size, c.local_rank, c.local_size, c.node, c.num_nodes)


def small_ints(tag: str, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Integers in [0, 16): sums over 8 ranks are exact in every dtype."""
    seed = sum(map(ord, tag)) * 1009 + rank
    return np.random.default_rng(seed).integers(0, 16, size=shape).astype(np.int64)


def run_collectives(c: a2a.Comm, tag: str) -> list[tuple[str, object, object]]:
    """Every collective on c: (name, (result, error), expected), nothing asserted."""
    n, r = c.size, c.rank
    checks = []
    shape, fshape = (n * 3, 2), (2, n * 2, 3)
    counts = ref.v_counts("varied", n)
    x = ref.a2a_input(f"{tag}-a2a", r, n, shape, "float64")
    fx = ref.flex_input(f"{tag}-flex", r, n, fshape, 1, "float32")
    vx = ref.v_input(f"{tag}-v", r, counts, (2,), "int32")
    for algo in ("linear", "2dh"):
        checks.append(
            (
                f"all_to_all {algo}",
                outcome(partial(a2a.all_to_all, x, comm=c, algo=algo)),
                ref.a2a_expected(f"{tag}-a2a", r, n, shape, "float64"),
            )
        )
        checks.append(
            (
                f"all_to_all_flex {algo}",
                outcome(partial(a2a.all_to_all_flex, fx, comm=c, split_axis=1, concat_axis=2, algo=algo)),
                ref.flex_expected(f"{tag}-flex", r, n, fshape, 1, 2, "float32"),
            )
        )
        y, error = outcome(partial(a2a.all_to_all_v, vx, counts[r], comm=c, algo=algo))
        checks.append(
            (
                f"all_to_all_v {algo}",
                (None if y is None else y[0], error),
                ref.v_expected(f"{tag}-v", r, counts, (2,), "int32")[0],
            )
        )
    inputs = [small_ints(f"{tag}-dense", q, (n * 2, 3)) for q in range(n)]
    mine = inputs[r].astype(np.float32)
    stacked = np.stack(inputs)
    total = np.sum(stacked, axis=0).astype(np.float32)
    gathered = np.concatenate(inputs, axis=0).astype(np.float32)
    checks.append(("all_gather", outcome(partial(a2a.all_gather, mine, comm=c)), gathered))
    checks.append(("all_reduce", outcome(partial(a2a.all_reduce, mine, comm=c)), total))
    checks.append(
        (
            "all_reduce max",
            outcome(partial(a2a.all_reduce, mine, comm=c, op="max")),
            np.max(stacked, axis=0).astype(np.float32),
        )
    )
    checks.append(
        ("reduce_scatter", outcome(partial(a2a.reduce_scatter, mine, comm=c)), total[r * 2 : (r + 1) * 2])
    )
    return checks


def assert_checks(checks, where: str) -> None:
    for name, (result, error), expected in checks:
        assert error is None, f"{where}: {name} raised {error!r}"
        ref.assert_bitwise_equal(result, expected, f"{where}: {name}")


def split_by(comm: a2a.Comm, plan) -> a2a.Comm | None:
    color, key = world_entries(comm, plan)[comm.rank][:2]
    return comm.split(color, key)


def test_split_places_ranks_and_runs_every_collective(comm):
    results = {}
    for name, plan in SPLITS.items():
        child = split_by(comm, plan)
        checks = (
            []
            if child is None
            else run_collectives(child, f"{name}{world_entries(comm, plan)[comm.rank][0]}")
        )
        results[name] = (topology(child), child, checks)
    for name, plan in SPLITS.items():
        got, child, checks = results[name]
        want = expected_child(world_entries(comm, plan), comm.rank)
        assert got == want, f"{name}: rank {comm.rank} got {got}, expected {want}"
        if child is not None:
            assert (child.device, child.transport, child.cuda_device) == (
                comm.device,
                comm.transport,
                comm.cuda_device,
            )
            assert child.mpi_thread_level == comm.mpi_thread_level and child.mpi_comm is None
            assert_checks(checks, f"split {name!r}, rank {comm.rank}")


def test_split_into_blocks_of_every_divisor(comm):
    """Consecutive blocks of g ranks, for every g dividing the size: children
    of the same size, nodes taken from the parent's."""
    divisors = [g for g in range(1, comm.size + 1) if comm.size % g == 0]
    results = []
    for g in divisors:
        child = comm.split(comm.rank // g)
        x = ref.a2a_input(f"block{g}", child.rank, g, (g * 4,), "int64")
        results.append((g, topology(child), outcome(partial(a2a.all_to_all, x, comm=child, algo="2dh"))))
    for g, got, (result, error) in results:
        entries = [(r // g, r, r // comm.local_size) for r in range(comm.size)]
        want = expected_child(entries, comm.rank)
        assert got == want, f"blocks of {g}: got {got}, expected {want}"
        assert error is None, f"blocks of {g}: 2dh all_to_all raised {error!r}"
        expected = ref.a2a_expected(f"block{g}", got[0], g, (g * 4,), "int64")
        ref.assert_bitwise_equal(result, expected, f"blocks of {g}")


def test_children_used_interleaved_with_the_parent(comm):
    n, r = comm.size, comm.rank
    odd_even = comm.split(r % 2)
    halves = comm.split(int(r >= n // 2), key=-r)
    copy = comm.split(0)  # the whole parent again
    steps = []

    def a2a_step(c, label, algo):
        x = ref.a2a_input(label, c.rank, c.size, (c.size * 2, 3), "int32")
        steps.append(
            (
                label,
                outcome(lambda: a2a.all_to_all(x, comm=c, algo=algo)),
                ref.a2a_expected(label, c.rank, c.size, (c.size * 2, 3), "int32"),
            )
        )

    def reduce_step(c, label):
        inputs = [small_ints(label, q, (5,)) for q in range(c.size)]
        steps.append(
            (
                label,
                outcome(lambda: a2a.all_reduce(inputs[c.rank].astype(np.int64), comm=c)),
                np.sum(np.stack(inputs), axis=0),
            )
        )

    for round_ in range(2):
        a2a_step(comm, f"parent{round_}", "linear")
        a2a_step(odd_even, f"odd-even{r % 2}-{round_}", "2dh")
        reduce_step(halves, f"halves{int(r >= n // 2)}-{round_}")
        reduce_step(comm, f"parent-sum{round_}")
        a2a_step(copy, f"copy{round_}", "2dh")
        a2a_step(halves, f"halves-a2a{int(r >= n // 2)}-{round_}", "linear")
        reduce_step(odd_even, f"odd-even-sum{r % 2}-{round_}")
    assert topology(copy) == expected_child(world_entries(comm, lambda q, *_: (0, q)), r)
    assert_checks(steps, f"rank {r}")


def test_split_a_child_again(comm):
    n, r = comm.size, comm.rank
    parity_plan = SPLITS["parity"]
    child = split_by(comm, parity_plan)
    grandchild = child.split(int(child.rank >= child.size // 2), key=child.size - child.rank)
    checks = run_collectives(grandchild, f"grand{r % 2}{int(child.rank >= child.size // 2)}")

    # The reference: the child level from the world's entries, then the
    # grandchild level from the entries of this rank's child.
    entries = world_entries(comm, parity_plan)
    child_topologies = {q: expected_child(entries, q) for q in range(n)}
    members = sorted(
        (q for q in range(n) if entries[q][0] == entries[r][0]), key=lambda q: child_topologies[q][0]
    )
    child_entries = []
    for q in members:
        crank, csize, _, _, cnode, _ = child_topologies[q]
        child_entries.append((int(crank >= csize // 2), csize - crank, cnode))
    want = expected_child(child_entries, child_topologies[r][0])
    assert topology(child) == child_topologies[r]
    assert topology(grandchild) == want, f"rank {r}: got {topology(grandchild)}, expected {want}"
    assert_checks(checks, f"grandchild of rank {r}")


def test_a_child_outlives_its_parent(world):
    parent = a2a.Comm.from_mpi(world)
    n, r = parent.size, parent.rank
    child = parent.split(0, key=-r)  # reversed
    del parent
    gc.collect()
    checks = run_collectives(child, "orphan")
    assert topology(child)[:2] == (n - 1 - r, n)
    assert_checks(checks, f"rank {r}, after its parent was dropped")


def test_undefined_everywhere_gives_no_child(comm):
    child = comm.split(None)
    x = ref.a2a_input("after-none", comm.rank, comm.size, (comm.size,), "float32")
    result = a2a.all_to_all(x, comm=comm)
    assert child is None
    ref.assert_bitwise_equal(
        result, ref.a2a_expected("after-none", comm.rank, comm.size, (comm.size,), "float32")
    )


def test_a_bad_color_raises_on_every_rank(comm):
    """A color that is not an int (checked in Python) and a negative one
    (checked by the core, through the native call) on the last rank: it raises
    InvalidArgumentError, the others RemoteError; the parent stays usable."""
    bad = comm.size - 1
    not_an_int = outcome(lambda: comm.split("red" if comm.rank == bad else 0))[1]
    negative = outcome(lambda: comm._native.split(-5 if comm.rank == bad else 0, comm.rank))[1]
    bad_key = outcome(lambda: comm.split(0, key=0.5 if comm.rank == bad else None))[1]
    x = ref.a2a_input("after-bad", comm.rank, comm.size, (comm.size * 2,), "int64")
    result = outcome(lambda: a2a.all_to_all(x, comm=comm))
    check_bad_rank(comm, bad, "split", not_an_int, "color must be an int", "str 'red'")
    check_bad_rank(comm, bad, "split", negative, "color -5 is negative", "A2A_UNDEFINED")
    check_bad_rank(comm, bad, "split", bad_key, "key must be an int", "float 0.5")
    assert result[1] is None, repr(result[1])
    ref.assert_bitwise_equal(
        result[0], ref.a2a_expected("after-bad", comm.rank, comm.size, (comm.size * 2,), "int64")
    )


def test_split_against_another_collective_is_a_mismatch(comm, need_two):
    x = np.ones(4, np.float32)
    error = outcome(lambda: comm.split(0) if comm.rank == 0 else a2a.all_reduce(x, comm=comm))[1]
    y = outcome(lambda: a2a.all_reduce(x, comm=comm))
    check_mismatch(error, "different collectives", "split", "all_reduce")
    assert y[1] is None, repr(y[1])
    np.testing.assert_array_equal(y[0], np.full(4, comm.size, np.float32))
