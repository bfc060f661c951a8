"""The dense collectives (all_gather, all_reduce, reduce_scatter) under
mpirun against NumPy, every dtype and reduction. Inputs are small integers,
so sums are exact in every dtype (float16/bfloat16 included) and results can
be compared bitwise whatever order MPI reduces in."""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome

import a2a

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8")
NUMPY_OPS = {"sum": np.sum, "max": np.max, "min": np.min}


def values(tag: str, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Integers in [0, 16): 8 ranks sum to at most 120, exact in int8 and bfloat16."""
    seed = sum(map(ord, tag)) * 1009 + rank
    return np.random.default_rng(seed).integers(0, 16, size=shape).astype(np.int64)


def as_dtype(a: np.ndarray, dtype: str):
    """a (exact integers) in dtype: a NumPy array, or a torch tensor for bfloat16."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return a.astype(dtype)


def as_int(x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = x.float().numpy()
    return x.astype(np.int64)


def all_inputs(comm, tag, shape):
    return [values(tag, r, shape) for r in range(comm.size)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (0, 2)], ids=str)
def test_all_gather(comm, dtype, shape):
    inputs = all_inputs(comm, f"gather{shape}", shape)
    got = a2a.all_gather(as_dtype(inputs[comm.rank], dtype), comm=comm)
    assert tuple(got.shape) == (comm.size * shape[0], *shape[1:])
    np.testing.assert_array_equal(as_int(got), np.concatenate(inputs, axis=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(NUMPY_OPS))
def test_all_reduce(comm, dtype, op):
    shape = (7, 3)
    inputs = all_inputs(comm, f"reduce{op}", shape)
    got = a2a.all_reduce(as_dtype(inputs[comm.rank], dtype), comm=comm, op=op)
    np.testing.assert_array_equal(as_int(got), NUMPY_OPS[op](np.stack(inputs), axis=0))


def test_all_reduce_in_place_and_empty(comm):
    inputs = all_inputs(comm, "inplace", (9,))
    x = inputs[comm.rank].astype(np.float32)
    result = a2a.all_reduce(x, comm=comm, out=x)
    empty = a2a.all_reduce(np.zeros(0, np.int32), comm=comm)
    assert result is x and empty.shape == (0,)
    np.testing.assert_array_equal(x, np.sum(np.stack(inputs), axis=0).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(NUMPY_OPS))
def test_reduce_scatter(comm, dtype, op):
    shape = (comm.size * 3, 2)
    inputs = all_inputs(comm, f"scatter{op}", shape)
    got = a2a.reduce_scatter(as_dtype(inputs[comm.rank], dtype), comm=comm, op=op)
    want = NUMPY_OPS[op](np.stack(inputs), axis=0)[comm.rank * 3 : (comm.rank + 1) * 3]
    assert tuple(got.shape) == (3, 2)
    np.testing.assert_array_equal(as_int(got), want)


def test_reductions_in_pieces(world):
    # A2A_MPI_MAX_COUNT (read at creation) caps the elements per MPI call:
    # 64 bytes are 16 float32, so 1000 elements take 63 calls, and every
    # reduce-scatter block of 333 is cut into 21 packed pieces.
    os.environ["A2A_MPI_MAX_COUNT"] = "64"
    try:
        comm = a2a.Comm.from_mpi(world)
    finally:
        del os.environ["A2A_MPI_MAX_COUNT"]
    inputs = all_inputs(comm, "pieces", (1000,))
    reduced = a2a.all_reduce(inputs[comm.rank].astype(np.float32), comm=comm)
    blocks = all_inputs(comm, "scatter-pieces", (comm.size * 333,))
    scattered = a2a.reduce_scatter(blocks[comm.rank].astype(np.float16), comm=comm, op="max")
    np.testing.assert_array_equal(as_int(reduced), np.sum(np.stack(inputs), axis=0))
    want = np.max(np.stack(blocks), axis=0)[comm.rank * 333 : (comm.rank + 1) * 333]
    np.testing.assert_array_equal(as_int(scattered), want)


def test_matches_mpi4py(comm, world):
    from mpi4py import MPI

    x = values("mpi4py", comm.rank, (11,)).astype(np.float64)
    want = np.empty_like(x)
    world.Allreduce(x, want, op=MPI.MAX)
    ref.assert_bitwise_equal(a2a.all_reduce(x, comm=comm, op="max"), want, "all_reduce max vs MPI_Allreduce")


# ---------------------------------------------------------------------------
# Errors: every rank raises, nobody hangs, and the comm keeps working.


def test_dtype_mismatch_across_ranks(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    x = np.zeros(4, np.float32 if comm.rank == 0 else np.float64)
    _, error = outcome(lambda: a2a.all_reduce(x, comm=comm))
    after = a2a.all_reduce(np.ones(2, np.int32), comm=comm)
    check_mismatch(error, "all_reduce", "'dtype' differs", "float32", "float64")
    np.testing.assert_array_equal(after, np.full(2, comm.size))


def test_op_mismatch_across_ranks(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    _, error = outcome(lambda: a2a.all_reduce(np.ones(3), comm=comm, op="max" if comm.rank == 0 else "min"))
    check_mismatch(error, "'reduce_op' differs", "max", "min")


def test_unknown_op_on_one_rank(comm):
    bad = comm.size - 1
    _, error = outcome(lambda: a2a.all_reduce(np.ones(3), comm=comm, op="prod" if comm.rank == bad else "sum"))
    check_bad_rank(comm, bad, "all_reduce", error, "unknown op 'prod'")


def test_reduce_scatter_rows_not_divisible(comm):
    if comm.size < 2:
        pytest.skip("every row count is divisible by 1")
    # Every rank passes size + 1 rows: each rejects its own input.
    _, error = outcome(lambda: a2a.reduce_scatter(np.ones((comm.size + 1, 2)), comm=comm))
    assert isinstance(error, a2a.InvalidArgumentError), repr(error)
    assert f"rank {comm.rank} of {comm.size}" in str(error) and "not divisible by the world size" in str(error)


def test_all_gather_overlapping_buffers_on_one_rank(comm):
    bad = comm.size - 1
    buffer = np.zeros(comm.size + 1, np.float32)
    send = buffer[:1] if comm.rank == bad else np.zeros(1, np.float32)
    out = buffer[1:] if comm.rank == bad else np.zeros(comm.size, np.float32)
    out_overlapping = buffer[: comm.size] if comm.rank == bad else out
    _, error = outcome(lambda: a2a.all_gather(send, comm=comm, out=out_overlapping))
    check_bad_rank(comm, bad, "all_gather", error, "overlap")
