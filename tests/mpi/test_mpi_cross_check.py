"""cross_check=False (A2A_CROSS_CHECK=0): the collectives skip the check that
every rank called them alike and still move the right bytes; the setting
must be equal on every rank, which creation checks on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from a2a_mpi_util import expect_mismatch, regular

import a2a


@pytest.fixture(scope="module")
def unchecked(world):
    return a2a.Comm.from_mpi(world, cross_check=False)


def test_the_setting_is_reported(comm, unchecked):
    assert comm.cross_check is True and unchecked.cross_check is False


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_all_to_all_without_the_check_equals_the_checked_one(comm, unchecked, algo):
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    x = (np.arange(comm.size * 5, dtype=np.float64) + 1000 * comm.rank).reshape(comm.size, 5)
    expected = np.stack([np.arange(5, dtype=np.float64) + 5 * comm.rank + 1000 * src for src in range(comm.size)])
    for c in (comm, unchecked):
        np.testing.assert_array_equal(a2a.all_to_all(x, comm=c, algo=algo), expected)


def test_flex_and_v_without_the_check(comm, unchecked):
    x = np.arange(2 * comm.size * 3 * 4, dtype=np.float32).reshape(2 * comm.size, 3, 4) + comm.rank
    want = a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1)
    np.testing.assert_array_equal(a2a.all_to_all_flex(x, comm=unchecked, split_axis=0, concat_axis=1), want)
    counts = [(comm.rank + peer) % 3 for peer in range(comm.size)]
    rows = np.arange(sum(counts) * 2, dtype=np.int32).reshape(-1, 2) + 100 * comm.rank
    got, got_counts = a2a.all_to_all_v(rows, counts, comm=unchecked)
    want, want_counts = a2a.all_to_all_v(rows, counts, comm=comm)
    np.testing.assert_array_equal(got, want)
    assert list(got_counts) == list(want_counts)


def test_bad_input_still_fails_on_the_rank_that_has_it(unchecked):
    # Without the check only the rank with the bad input knows; no peer waits, since nothing is sent.
    if unchecked.size == 1:
        pytest.skip("needs peers")
    with pytest.raises(a2a.InvalidArgumentError, match="not divisible"):
        a2a.all_to_all(np.zeros(unchecked.size + 1, np.float32), comm=unchecked)


def test_ranks_that_differ_in_the_setting_fail_at_creation_on_every_rank(world, comm):
    if comm.size == 1:
        pytest.skip("needs peers")
    expect_mismatch(lambda: a2a.Comm.from_mpi(world, cross_check=comm.rank != 0),
                    "cross-checks", f"cross_check={0 if comm.rank == 0 else 1}")
