"""all_to_all_v (MPI_Alltoallv with the count exchange inside) under mpirun."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import regular, run_or_expect_rejection

import a2a

ALGOS = ["linear", "2dh"]
ROW_SHAPES = {"scalar-rows": (), "rows5": (5,), "rows2x3": (2, 3), "empty-rows": (0,)}  # empty: the counts travel apart


@pytest.mark.parametrize("row", list(ROW_SHAPES))
@pytest.mark.parametrize("pattern", ref.V_PATTERNS)
@pytest.mark.parametrize("dtype", ["float32", "int8", "float64", "uint8"])
@pytest.mark.parametrize("algo", ALGOS)
def test_v_matches_reference(comm, algo, dtype, pattern, row):
    row_shape = ROW_SHAPES[row]
    counts = ref.v_counts(pattern, comm.size)
    tag = f"v-{pattern}-{dtype}-{row}"
    inputs = [ref.v_input(tag, r, counts, row_shape, dtype) for r in range(comm.size)]
    expected, expected_counts = ref.ref_all_to_all_v(inputs, counts)[comm.rank]
    x = inputs[comm.rank]
    result = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo=algo))
    block_recv, block_counts = ref.v_expected(tag, comm.rank, counts, row_shape, dtype)
    ref.assert_bitwise_equal(expected, block_recv, "reference")
    if result is None:
        return
    y, recv_counts = result
    assert isinstance(recv_counts, np.ndarray) and recv_counts.dtype == np.int64
    assert recv_counts.tolist() == expected_counts.tolist() == block_counts.tolist()
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype
    ref.assert_bitwise_equal(y, expected, f"{pattern} {algo} rank {comm.rank}")


@pytest.mark.parametrize("pattern", ref.V_PATTERNS)
def test_v_linear_and_2dh_agree_bitwise(comm, pattern):
    if not regular(comm):
        pytest.skip("2dh needs a regular topology")
    counts = ref.v_counts(pattern, comm.size)
    x = ref.v_input("v-lin-2dh", comm.rank, counts, (3,), "float16")
    y1, c1 = a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo="linear")
    y2, c2 = a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo="2dh")
    assert c1.tolist() == c2.tolist()
    ref.assert_bitwise_equal(y2, y1, "2dh vs linear")


@pytest.mark.parametrize(
    "counts_as",
    ["list", "tuple", "int32", "int64", "torch"],
)
def test_v_counts_types(comm, counts_as):
    counts = ref.v_counts("varied", comm.size)
    mine = counts[comm.rank]
    if counts_as == "list":
        send = [int(c) for c in mine]
    elif counts_as == "tuple":
        send = tuple(int(c) for c in mine)
    elif counts_as == "torch":
        torch = pytest.importorskip("torch")
        send = torch.tensor(mine.tolist())
    else:
        send = mine.astype(counts_as)
    x = ref.v_input("v-types", comm.rank, counts, (2,), "int32")
    y, recv_counts = a2a.all_to_all_v(x, send, comm=comm)
    expected, expected_counts = ref.v_expected("v-types", comm.rank, counts, (2,), "int32")
    ref.assert_bitwise_equal(y, expected)
    assert recv_counts.tolist() == expected_counts.tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("algo", ALGOS)
def test_v_torch(comm, torch, algo, dtype):
    counts = ref.v_counts("zero_to_next", comm.size)
    bits = ref.v_input(f"v-torch-{dtype}", comm.rank, counts, (4,), dtype)
    x = ref.to_framework(bits, dtype, "torch")
    result = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo=algo))
    if result is None:
        return
    y, recv_counts = result
    assert isinstance(y, torch.Tensor) and y.dtype == getattr(torch, dtype)
    expected, expected_counts = ref.v_expected(f"v-torch-{dtype}", comm.rank, counts, (4,), dtype)
    ref.assert_bitwise_equal(y, expected)
    assert recv_counts.tolist() == expected_counts.tolist()


@pytest.mark.parametrize("algo", ALGOS)
def test_v_out(comm, algo):
    counts = ref.v_counts("varied", comm.size)
    x = ref.v_input("v-out", comm.rank, counts, (3,), "float64")
    expected, _ = ref.v_expected("v-out", comm.rank, counts, (3,), "float64")
    out = np.full(expected.shape, np.nan)
    result = run_or_expect_rejection(
        comm, algo, lambda: a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo=algo, out=out)
    )
    if result is None:
        return
    assert result[0] is out
    ref.assert_bitwise_equal(out, expected)


def test_v_equal_counts_match_all_to_all(comm):
    """With equal counts all_to_all_v is all_to_all."""
    shape = (comm.size * 6, 4)
    x = ref.a2a_input("v-eq", comm.rank, comm.size, shape, "float32")
    y, counts = a2a.all_to_all_v(x, [6] * comm.size, comm=comm)
    assert counts.tolist() == [6] * comm.size
    ref.assert_bitwise_equal(y, a2a.all_to_all(x, comm=comm))


def test_v_repeated_with_changing_counts(comm):
    algos = ALGOS if regular(comm) else ["linear"]
    results = []
    for i, pattern in enumerate(ref.V_PATTERNS * 2):
        counts = ref.v_counts(pattern, comm.size)
        if i % 2:
            counts = counts * 3 + (np.arange(comm.size) % 2)  # vary the sizes
        x = ref.v_input(f"v-rep{i}", comm.rank, counts, (7,), "int8")
        for algo in algos:
            y, _ = a2a.all_to_all_v(x, counts[comm.rank], comm=comm, algo=algo)
            results.append((i, pattern, counts, algo, y))
    for i, pattern, counts, algo, y in results:
        expected, _ = ref.v_expected(f"v-rep{i}", comm.rank, counts, (7,), "int8")
        ref.assert_bitwise_equal(y, expected, f"{pattern} #{i} {algo}")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("pattern", ref.V_PATTERNS)
def test_plan_v_runs_many_times(comm, algo, pattern):
    """One plan, several inputs: each run equals a fresh all_to_all_v."""
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs a regular topology")
    counts = ref.v_counts(pattern, comm.size)
    first = ref.v_input(f"plan-{pattern}-0", comm.rank, counts, (3,), "float32")
    plan = a2a.plan_v(counts[comm.rank], like=first, comm=comm, algo=algo)
    for step in range(3):
        tag = f"plan-{pattern}-{step}"
        x = ref.v_input(tag, comm.rank, counts, (3,), "float32")
        expected, expected_counts = ref.v_expected(tag, comm.rank, counts, (3,), "float32")
        assert plan.recv_counts.tolist() == expected_counts.tolist()
        ref.assert_bitwise_equal(plan.run(x), expected, f"run {step}")
        out = np.empty_like(expected)
        assert plan.run(x, out=out) is out
        ref.assert_bitwise_equal(out, expected, f"run {step} with out=")


def test_plan_v_with_torch(comm, torch):
    counts = ref.v_counts("varied", comm.size)
    x = ref.v_input("plan-torch", comm.rank, counts, (2,), "float32")
    expected, _ = ref.v_expected("plan-torch", comm.rank, counts, (2,), "float32")
    plan = a2a.plan_v(torch.as_tensor(counts[comm.rank]), like=torch.from_numpy(x), comm=comm)
    y = plan.run(torch.from_numpy(x))
    assert isinstance(y, torch.Tensor)
    ref.assert_bitwise_equal(y.numpy(), expected, "torch run")


def test_plan_v_rejects_an_input_that_does_not_fit(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
    counts = [2] * comm.size
    x = np.zeros((2 * comm.size, 3), np.float32)
    plan = a2a.plan_v(counts, like=x, comm=comm)
    bad = comm.size - 1
    y = np.zeros((2 * comm.size + (1 if comm.rank == bad else 0), 3), np.float32)
    with pytest.raises((a2a.InvalidArgumentError, a2a.RemoteError)) as info:
        plan.run(y)
    if comm.rank == bad:
        assert isinstance(info.value, a2a.InvalidArgumentError)
        assert f"has {2 * comm.size + 1} rows but the plan sends {2 * comm.size}" in str(info.value)
    else:
        assert isinstance(info.value, a2a.RemoteError)
    ref.assert_bitwise_equal(plan.run(x), np.zeros_like(x), "the plan after the error")
