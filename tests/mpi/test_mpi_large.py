"""Large messages: 64 MiB per rank, and the BigMPI (>2^31 bytes) code path
exercised with small buffers by lowering A2A_MPI_MAX_COUNT.

The 64 MiB runs take 5-10 s a configuration on the shared 2-core machine;
A2A_TEST_LARGE=0 skips them where tests/run_mpi.py's matrix already has
them at the same size of world and data path (tests/run_mpi.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import Deferred, regular, run_or_expect_rejection
from launcher import rank_and_size

import a2a

MIB64 = 64 * 2**20
# Applied to each 64 MiB test.
large = pytest.mark.skipif(os.environ.get("A2A_TEST_LARGE", "1") == "0",
                           reason="A2A_TEST_LARGE=0: the 64 MiB runs are in another configuration of the matrix")


# ---------------------------------------------------------------------------
# 64 MiB per rank. Expectations are built block-wise: each rank generates only
# its own input and the blocks it receives.


@pytest.fixture(scope="module")
def big_a2a(request):
    rank, size = rank_and_size(request)  # the comm's (over the whole job), which may be made per test
    row = 1024  # float32 elements: 4 KiB rows
    rows_per_peer = MIB64 // (4 * row) // size
    shape = (size * rows_per_peer, row)
    x = ref.a2a_input("big", rank, size, shape, "float32")
    expected = ref.a2a_expected("big", rank, size, shape, "float32")
    assert x.nbytes > MIB64 - size * 4 * row
    return x, expected


@pytest.fixture(scope="module")
def big_results():
    return {}


@large
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_64mib_all_to_all(comm, big_a2a, big_results, algo):
    x, expected = big_a2a
    y = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all(x, comm=comm, algo=algo))
    if y is None:
        return
    ref.assert_bitwise_equal(y, expected, f"64 MiB {algo}")
    big_results[algo] = y


@large
def test_64mib_linear_and_2dh_agree(comm, big_results):
    if not regular(comm):
        pytest.skip("2dh needs a regular topology")
    assert set(big_results) == {"linear", "2dh"}, "the 64 MiB runs above failed"
    ref.assert_bitwise_equal(big_results["2dh"], big_results["linear"], "64 MiB 2dh vs linear")
    big_results.clear()


@large
def test_64mib_flex_datatypes_and_copies(comm, comm_copies):
    """(64, W*m, 256) float32, split 1 / concat 0: strided MPI datatypes of 64
    blocks on one comm, packing copies on the other."""
    m = 1024 // comm.size
    shape = (64, comm.size * m, 256)
    x = ref.flex_input("bigflex", comm.rank, comm.size, shape, 1, "float32")
    expected = ref.flex_expected("bigflex", comm.rank, comm.size, shape, 1, 0, "float32")
    checks = Deferred()
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0)
    checks.run(ref.assert_bitwise_equal, y, expected, "64 MiB flex, datatypes")
    del y
    y = a2a.all_to_all_flex(x, comm=comm_copies, split_axis=1, concat_axis=0)
    checks.run(ref.assert_bitwise_equal, y, expected, "64 MiB flex, copies")
    checks.done()


@large
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_64mib_all_to_all_v(comm, algo):
    row = 1024
    total_rows = MIB64 // (4 * row)
    base = total_rows // comm.size
    counts = np.empty((comm.size, comm.size), np.int64)
    for s in range(comm.size):
        for d in range(comm.size):
            counts[s, d] = base - 3 + (s + 2 * d) % 5  # uneven, about 64 MiB in all
    x = ref.v_input("bigv", comm.rank, counts, (row,), "float32")
    expected, expected_counts = ref.v_expected("bigv", comm.rank, counts, (row,), "float32")
    result = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo=algo))
    if result is None:
        return
    ref.assert_bitwise_equal(result[0], expected, f"64 MiB all_to_all_v {algo}")
    assert result[1].tolist() == expected_counts.tolist()


# ---------------------------------------------------------------------------
# A2A_MPI_MAX_COUNT: messages above it travel as derived datatypes of
# max-count pieces (plus a remainder); results must not change.


@pytest.fixture(scope="module", params=["1000", "777", "777-copies"])
def small_max_comm(request, world):
    value, _, copies = request.param.partition("-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("A2A_MPI_MAX_COUNT", value)
        c = a2a.Comm.from_mpi(world, use_mpi_datatypes=not copies)
    c.max_count = int(value)
    return c


def chunk_sizes(max_count):
    return [1, max_count - 1, max_count, max_count + 1, 2 * max_count, 2 * max_count + 3, 5 * max_count + 17]


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_max_count_all_to_all(comm, small_max_comm, algo):
    c = small_max_comm
    checks = Deferred()
    for per_peer in chunk_sizes(c.max_count):
        shape = (c.size * per_peer,)
        tag = f"maxcount-{per_peer}"
        x = ref.a2a_input(tag, c.rank, c.size, shape, "uint8")
        expected = ref.a2a_expected(tag, c.rank, c.size, shape, "uint8")
        y = run_or_expect_rejection(c, algo, lambda x=x: a2a.all_to_all(x, comm=c, algo=algo))
        if y is None:
            return
        default = a2a.all_to_all(x, comm=comm, algo=algo)
        checks.run(ref.assert_bitwise_equal, y, expected, f"{per_peer} bytes per peer, max count {c.max_count}")
        checks.run(ref.assert_bitwise_equal, y, default, f"{per_peer} bytes per peer, vs the default comm")
    checks.done()


@pytest.mark.parametrize(
    "shape_of, split, concat",
    [
        (lambda w: (3, w * 2, 700), 1, 0),  # blocks of 1400 bytes (> max count)
        (lambda w: (5, w, 100), 1, 2),  # blocks of 200 bytes (< max count)
        (lambda w: (w * 3, 4, 999), 0, 1),  # contiguous chunks of 11988 bytes
        (lambda w: (2, 3, w * 1001), 2, 0),  # 1001-byte blocks
    ],
    ids=["big-blocks", "small-blocks", "contiguous", "last-axis"],
)
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_max_count_flex(comm, small_max_comm, algo, shape_of, split, concat):
    c = small_max_comm
    shape = shape_of(c.size)
    x = ref.flex_input("maxcount-flex", c.rank, c.size, shape, split, "uint8")
    expected = ref.flex_expected("maxcount-flex", c.rank, c.size, shape, split, concat, "uint8")
    y = run_or_expect_rejection(
        c, algo, lambda: a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat, algo=algo)
    )
    if y is None:
        return
    default = a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=concat, algo=algo)
    ref.assert_bitwise_equal(y, expected, f"max count {c.max_count}")
    ref.assert_bitwise_equal(y, default, "vs the default comm")


@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("pattern", ["varied", "empty_odd_ranks", "odd_large"])
def test_max_count_v(comm, small_max_comm, algo, pattern):
    c = small_max_comm
    counts = ref.v_counts(pattern, c.size) * 97  # rows of 3 float32: up to ~13 KB per message
    tag = f"maxcount-v-{pattern}"
    x = ref.v_input(tag, c.rank, counts, (3,), "float32")
    expected, _ = ref.v_expected(tag, c.rank, counts, (3,), "float32")
    result = run_or_expect_rejection(c, algo, lambda: a2a.all_to_all_v(x, counts[c.rank], comm=c, algo=algo))
    if result is None:
        return
    default, _ = a2a.all_to_all_v(x, counts[c.rank], comm=comm, algo=algo)
    ref.assert_bitwise_equal(result[0], expected, f"max count {c.max_count}")
    ref.assert_bitwise_equal(result[0], default, "vs the default comm")
