"""The uneven dense collectives (all_gather_v, reduce_scatter_v) under mpirun
against NumPy: counts with odd values and zeros, every dtype and reduction,
NumPy and torch, the large-message paths, and the errors (every rank raises,
nobody hangs, and the comm keeps working).

all_gather_v moves random bytes (NaNs and all) and is compared bitwise;
reduce_scatter_v reduces small integers, exact in every dtype, so it is
compared bitwise too whatever order MPI reduces in. Their autograd is in
test_mpi_autograd.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome
from test_mpi_dense import DTYPES, NUMPY_OPS, as_dtype, as_int, values

import a2a
from a2a._arrays import NUMPY_CODES


def counts_for(pattern: str, world: int) -> list[int]:
    """Rows per rank, the same on every rank."""
    if pattern == "odd":  # 1, 3, 0, 2, 4, 1, ...: odd counts, and a zero from 3 ranks on
        return [(2 * r + 1) % 5 for r in range(world)]
    if pattern == "first-empty":
        return [0 if r == 0 else 2 * r + 1 for r in range(world)]
    if pattern == "last-only":
        return [0] * (world - 1) + [5]
    if pattern == "empty":
        return [0] * world
    raise ValueError(pattern)


PATTERNS = ("odd", "first-empty", "last-only", "empty")


def starts(counts: list[int]) -> list[int]:
    return [sum(counts[:r]) for r in range(len(counts) + 1)]


def gathered_input(tag: str, rank: int, counts: list[int], row_shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Rank `rank`'s rows: random bytes in dtype's NumPy storage."""
    return ref.block(tag, rank, 0, (counts[rank], *row_shape), dtype)


@pytest.mark.parametrize("dtype", ref.ALL_DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)], ids=str)
def test_all_gather_v(comm, dtype, pattern, row_shape):
    counts = counts_for(pattern, comm.size)
    inputs = [gathered_input(f"agv{pattern}", r, counts, row_shape, dtype) for r in range(comm.size)]
    framework = "torch" if dtype == "bfloat16" else "numpy"
    torch = pytest.importorskip("torch") if framework == "torch" else None
    got = a2a.all_gather_v(ref.to_framework(inputs[comm.rank], dtype, framework), counts, comm=comm)
    assert ref.framework_of(got) == framework and ref.dtype_name(got) == dtype
    if torch is not None:  # its int16 storage: raw_bytes cannot view an empty bfloat16 tensor
        got = got.view(torch.int16).numpy()
    ref.assert_bitwise_equal(got, np.concatenate(inputs, axis=0), f"all_gather_v {counts}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(NUMPY_OPS))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_reduce_scatter_v(comm, dtype, op, pattern):
    counts = counts_for(pattern, comm.size)
    start = starts(counts)
    inputs = [values(f"rsv{op}{pattern}", r, (start[-1], 3)) for r in range(comm.size)]
    got = a2a.reduce_scatter_v(as_dtype(inputs[comm.rank], dtype), counts, comm=comm, op=op)
    want = NUMPY_OPS[op](np.stack(inputs), axis=0)[start[comm.rank] : start[comm.rank + 1]]
    assert tuple(got.shape) == (counts[comm.rank], 3)
    np.testing.assert_array_equal(as_int(got), want)


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_torch_tensors_and_counts_of_every_kind(comm, torch, dtype):
    counts = counts_for("odd", comm.size)
    start = starts(counts)
    inputs = [values(f"torch{dtype}", r, (start[-1], 2)) for r in range(comm.size)]
    x = torch.from_numpy(inputs[comm.rank]).to(getattr(torch, dtype))
    as_tensor = torch.tensor(counts)
    reduced = a2a.reduce_scatter_v(x, as_tensor, comm=comm)
    mine = x[start[comm.rank] : start[comm.rank + 1]].contiguous()
    gathered = a2a.all_gather_v(mine, np.array(counts, dtype=np.int32), comm=comm)

    assert isinstance(reduced, torch.Tensor) and reduced.dtype == x.dtype
    np.testing.assert_array_equal(as_int(reduced), np.sum(np.stack(inputs), axis=0)[start[comm.rank] : start[comm.rank + 1]])
    assert isinstance(gathered, torch.Tensor)
    np.testing.assert_array_equal(
        as_int(gathered), np.concatenate([inputs[r][start[r] : start[r + 1]] for r in range(comm.size)])
    )


def test_out(comm):
    counts = counts_for("odd", comm.size)
    start = starts(counts)
    x = values("out", comm.rank, (counts[comm.rank], 2)).astype(np.float32)
    out = np.full((start[-1], 2), np.nan, np.float32)
    reduced_out = np.full((counts[comm.rank], 2), np.nan, np.float32)
    gathered = a2a.all_gather_v(x, counts, comm=comm, out=out)
    reduced = a2a.reduce_scatter_v(out, counts, comm=comm, out=reduced_out)

    everyone = np.concatenate([values("out", r, (counts[r], 2)) for r in range(comm.size)]).astype(np.float32)
    assert gathered is out and reduced is reduced_out
    np.testing.assert_array_equal(out, everyone)
    np.testing.assert_array_equal(reduced, comm.size * everyone[start[comm.rank] : start[comm.rank + 1]])


def test_matches_mpi4py(comm, world):
    """Allgatherv and Reduce_scatter with the same counts give the same bytes."""
    from mpi4py import MPI

    counts = counts_for("odd", comm.size)
    start = starts(counts)
    mine = values("mpi4py-v", comm.rank, (counts[comm.rank],)).astype(np.float64) / 7
    gathered = np.empty(start[-1])
    world.Allgatherv(mine, [gathered, counts])
    blocks = values("mpi4py-rs", comm.rank, (start[-1],)).astype(np.float64) / 3
    scattered = np.empty(counts[comm.rank])
    world.Reduce_scatter(blocks, scattered, counts, op=MPI.MAX)

    ref.assert_bitwise_equal(a2a.all_gather_v(mine, counts, comm=comm), gathered, "all_gather_v vs MPI_Allgatherv")
    ref.assert_bitwise_equal(
        a2a.reduce_scatter_v(blocks, counts, comm=comm, op="max"), scattered, "reduce_scatter_v vs MPI_Reduce_scatter"
    )


def test_large_message_paths(world):
    # A2A_MPI_MAX_COUNT (read at creation) caps the bytes per MPI call: 64
    # bytes are 16 float32, so blocks of up to 333 rows are reduced in 21
    # rounds of packed pieces (shorter blocks dropping out as they end), and
    # gathered blocks travel as derived datatypes.
    os.environ["A2A_MPI_MAX_COUNT"] = "64"
    try:
        comm = a2a.Comm.from_mpi(world)
    finally:
        del os.environ["A2A_MPI_MAX_COUNT"]
    counts = ([333, 0, 17, 100] * comm.size)[: comm.size - 1] + [48]
    start = starts(counts)
    blocks = [values("pieces-v", r, (start[-1],)) for r in range(comm.size)]
    scattered = a2a.reduce_scatter_v(blocks[comm.rank].astype(np.float32), counts, comm=comm, op="sum")
    mine = gathered_input("pieces-agv", comm.rank, counts, (), "float16")
    gathered = a2a.all_gather_v(mine.view(np.float16), counts, comm=comm)

    want = np.sum(np.stack(blocks), axis=0)[start[comm.rank] : start[comm.rank + 1]]
    np.testing.assert_array_equal(as_int(scattered), want)
    everyone = [gathered_input("pieces-agv", r, counts, (), "float16") for r in range(comm.size)]
    ref.assert_bitwise_equal(gathered, np.concatenate(everyone).view(np.float16), "all_gather_v in pieces")


def test_repeated_calls_with_changing_counts(comm):
    results = []
    for step, pattern in enumerate(PATTERNS * 2):
        counts = counts_for(pattern, comm.size)
        x = np.full((counts[comm.rank], 1), comm.rank + 10 * step, np.int32)
        results.append((counts, a2a.all_gather_v(x, counts, comm=comm)))
    for step, (counts, got) in enumerate(results):
        want = np.concatenate([np.full((c, 1), r + 10 * step, np.int32) for r, c in enumerate(counts)])
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# Errors: every rank raises, nobody hangs, and the comm keeps working.


def still_works(comm) -> None:
    counts = counts_for("odd", comm.size)
    got = a2a.all_gather_v(np.full(counts[comm.rank], comm.rank, np.int64), counts, comm=comm)
    np.testing.assert_array_equal(got, np.repeat(np.arange(comm.size), counts))


@pytest.mark.parametrize("op", ["all_gather_v", "reduce_scatter_v"])
def test_counts_differ_on_one_rank(comm, need_two, op):
    bad = comm.size - 1
    counts = counts_for("odd", comm.size)
    if comm.rank == bad:
        counts[0] += 2
    start = starts(counts)
    if op == "all_gather_v":
        call = lambda: a2a.all_gather_v(np.zeros(counts[comm.rank]), counts, comm=comm)
    else:
        call = lambda: a2a.reduce_scatter_v(np.zeros(start[-1]), counts, comm=comm)
    _, error = outcome(call)
    still_works(comm)
    want = counts_for("odd", comm.size)[0]
    check_mismatch(
        error,
        f"{op} on rank {comm.rank}",
        "'counts' differ across ranks",
        f"rank {bad} passed counts[0] = {want + 2} where rank 0 passed {want} (elements)",
    )


def test_counts_differ_in_a_later_entry_of_rows(comm, need_two):
    """Counts in rows of 3 elements: the message says how rows became elements."""
    bad = comm.size - 1
    counts = counts_for("odd", comm.size)
    if comm.rank == bad:
        counts[bad] += 1
    _, error = outcome(lambda: a2a.all_gather_v(np.zeros((counts[comm.rank], 3)), counts, comm=comm))
    want = counts_for("odd", comm.size)[bad]
    check_mismatch(
        error,
        f"rank {bad} passed counts[{bad}] = {3 * (want + 1)} where rank 0 passed {3 * want} (elements)",
        "rows x 3 elements per row",
    )


def test_row_shape_differs_on_one_rank(comm, need_two):
    counts = counts_for("first-empty", comm.size)
    width = 3 if comm.rank == comm.size - 1 else 2
    _, error = outcome(lambda: a2a.all_gather_v(np.zeros((counts[comm.rank], width)), counts, comm=comm))
    check_mismatch(error, "'counts' differ across ranks", f"x {width} elements per row")


def test_dtype_differs_on_one_rank(comm, need_two):
    counts = counts_for("odd", comm.size)
    x = np.zeros(sum(counts), np.float32 if comm.rank == 0 else np.float64)
    _, error = outcome(lambda: a2a.reduce_scatter_v(x, counts, comm=comm))
    still_works(comm)
    check_mismatch(error, "reduce_scatter_v", "'dtype' differs", "float32", "float64")


def test_op_differs_on_one_rank(comm, need_two):
    counts = counts_for("odd", comm.size)
    op = "max" if comm.rank == 0 else "min"
    _, error = outcome(lambda: a2a.reduce_scatter_v(np.ones(sum(counts)), counts, comm=comm, op=op))
    check_mismatch(error, "'reduce_op' differs", "max", "min")


def test_ranks_in_different_collectives(comm, need_two):
    counts = counts_for("odd", comm.size)
    if comm.rank == 0:
        call = lambda: a2a.all_gather(np.zeros(2), comm=comm)
    else:
        call = lambda: a2a.all_gather_v(np.zeros(counts[comm.rank]), counts, comm=comm)
    _, error = outcome(call)
    still_works(comm)
    check_mismatch(error, "ranks called different collectives", "all_gather_v")


def test_wrong_send_size_on_one_rank(comm):
    bad = comm.size - 1
    counts = counts_for("odd", comm.size)
    rows = counts[comm.rank] + (1 if comm.rank == bad else 0)
    _, error = outcome(lambda: a2a.all_gather_v(np.zeros((rows, 2)), counts, comm=comm))
    still_works(comm)
    check_bad_rank(comm, bad, "all_gather_v", error, f"has {rows} rows but counts[{bad}] is {counts[bad]}")


def test_reduce_scatter_rows_not_the_sum_on_one_rank(comm):
    bad = 0
    counts = counts_for("odd", comm.size)
    rows = sum(counts) - (1 if comm.rank == bad else 0)
    _, error = outcome(lambda: a2a.reduce_scatter_v(np.zeros(rows), counts, comm=comm))
    check_bad_rank(comm, bad, "reduce_scatter_v", error, f"has {rows} rows but counts sum to {sum(counts)}")


@pytest.mark.parametrize(
    "bad_counts, fragments",
    [
        (lambda size: [-1] + [1] * (size - 1), ["counts has negative entries", "-1"]),
        (lambda size: [1] * (size + 1), ["must be", "integers (rows of each rank)"]),
        (lambda size: [1.5] * size, ["integers"]),
    ],
    ids=["negative", "too-long", "float"],
)
def test_bad_counts_on_one_rank(comm, bad_counts, fragments):
    bad = comm.size - 1
    good = counts_for("odd", comm.size)
    counts = bad_counts(comm.size) if comm.rank == bad else good
    _, error = outcome(lambda: a2a.reduce_scatter_v(np.zeros(sum(good)), counts, comm=comm))
    still_works(comm)
    check_bad_rank(comm, bad, "reduce_scatter_v", error, *fragments)


def test_overlapping_buffers_on_one_rank(comm):
    bad = comm.size - 1
    counts = [1] * comm.size
    buffer = np.zeros(comm.size + 1, np.float32)
    send = buffer[:1] if comm.rank == bad else np.zeros(1, np.float32)
    out = buffer[: comm.size] if comm.rank == bad else np.zeros(comm.size, np.float32)
    _, error = outcome(lambda: a2a.all_gather_v(send, counts, comm=comm, out=out))
    check_bad_rank(comm, bad, "all_gather_v", error, "overlap")


# The core's own checks, reached through the native binding with what the
# Python layer would have rejected first.

FLOAT64 = NUMPY_CODES[np.dtype(np.float64)]


def test_core_rejects_negative_counts(comm):
    counts = [2] * comm.size
    counts[comm.size - 1] = -3
    x = np.zeros(2 * comm.size)
    y = np.zeros(2 * comm.size)
    _, error = outcome(lambda: comm._native.reduce_scatter_v(x.ctypes.data, y.ctypes.data, counts, FLOAT64, 0))
    still_works(comm)
    assert isinstance(error, a2a.InvalidArgumentError), repr(error)
    assert f"counts[{comm.size - 1}] is negative (-3)" in str(error), str(error)
    assert f"reduce_scatter_v on rank {comm.rank} of {comm.size}" in str(error), str(error)


def test_core_rejects_a_null_buffer_on_one_rank(comm):
    bad = comm.size - 1
    counts = [1] * comm.size
    x = np.ones(1)
    y = np.zeros(comm.size)
    recv = 0 if comm.rank == bad else y.ctypes.data
    _, error = outcome(lambda: comm._native.all_gather_v(x.ctypes.data, recv, counts, FLOAT64))
    check_bad_rank(comm, bad, "all_gather_v", error, f"recv buffer is NULL but must hold {8 * comm.size} bytes")


def test_core_counts_list_of_another_length_on_one_rank(comm):
    bad = 0
    counts = [1] * (comm.size + 1 if comm.rank == bad else comm.size)
    x = np.ones(comm.size)
    y = np.zeros(1)
    _, error = outcome(lambda: comm._native.reduce_scatter_v(x.ctypes.data, y.ctypes.data, counts, FLOAT64, 0))
    still_works(comm)
    check_bad_rank(comm, bad, "reduce_scatter_v", error, f"counts has {comm.size + 1} entries; pass one per rank")
