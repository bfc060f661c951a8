"""all_to_all under mpirun against the NumPy reference, and linear vs 2DH bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import regular, run_or_expect_rejection

import a2a

ALGOS = ["linear", "2dh"]

# name -> (rows per peer, row shape): 0 elements, 1 element per peer, odd counts.
SIZES = {
    "empty": (0, (3,)),
    "one": (1, ()),
    "odd7": (7, ()),
    "odd13x5": (13, (5,)),
    "rows3x2": (2, (3, 2)),
    "empty-rows": (3, (0,)),
}

# (dtype, framework): every NumPy dtype, and bfloat16 through torch.
DTYPES = [(d, "numpy") for d in ref.NUMPY_DTYPES] + [("bfloat16", "torch")]


def world_inputs(tag, world, shape, dtype):
    return [ref.a2a_input(tag, r, world, shape, dtype) for r in range(world)]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype, framework", DTYPES, ids=[d for d, _ in DTYPES])
@pytest.mark.parametrize("algo", ALGOS)
def test_all_to_all_matches_reference(comm, algo, dtype, framework, size):
    if framework == "torch":
        pytest.importorskip("torch")
    per_peer, row = SIZES[size]
    shape = (comm.size * per_peer, *row)
    tag = f"a2a-{size}-{dtype}"
    inputs = world_inputs(tag, comm.size, shape, dtype)
    expected = ref.ref_all_to_all(inputs)[comm.rank]
    x = ref.to_framework(inputs[comm.rank], dtype, framework)
    y = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all(x, comm=comm, algo=algo))
    # The block-wise expectation (used for the large cases) agrees.
    ref.assert_bitwise_equal(expected, ref.a2a_expected(tag, comm.rank, comm.size, shape, dtype), "reference")
    if y is None:
        return
    assert ref.framework_of(y) == framework
    assert ref.dtype_name(y) == dtype
    ref.assert_bitwise_equal(y, expected, f"rank {comm.rank} {algo}")
    ref.assert_bitwise_equal(x, inputs[comm.rank], "the input after the call")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("algo", ALGOS)
def test_all_to_all_torch(comm, torch, algo, dtype):
    shape = (comm.size * 5, 3)
    tag = f"a2a-torch-{dtype}"
    x = ref.to_framework(ref.a2a_input(tag, comm.rank, comm.size, shape, dtype), dtype, "torch")
    y = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all(x, comm=comm, algo=algo))
    if y is None:
        return
    assert isinstance(y, torch.Tensor), type(y)
    assert y.dtype == getattr(torch, dtype) and y.device.type == "cpu"
    ref.assert_bitwise_equal(y, ref.a2a_expected(tag, comm.rank, comm.size, shape, dtype))


@pytest.mark.parametrize("per_peer, row", [(1, ()), (7, (3,)), (64, (33,)), (0, (2,))], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "int8", "float64"])
def test_linear_and_2dh_agree_bitwise(comm, per_peer, row, dtype):
    if not regular(comm):
        pytest.skip("2dh needs a regular topology")
    shape = (comm.size * per_peer, *row)
    x = ref.a2a_input("lin-vs-2dh", comm.rank, comm.size, shape, dtype)
    linear = a2a.all_to_all(x, comm=comm, algo="linear")
    two_dh = a2a.all_to_all(x, comm=comm, algo="2dh")
    ref.assert_bitwise_equal(two_dh, linear, "2dh vs linear")
    ref.assert_bitwise_equal(linear, ref.a2a_expected("lin-vs-2dh", comm.rank, comm.size, shape, dtype))


@pytest.mark.parametrize("algo", ALGOS)
def test_all_to_all_out(comm, algo):
    shape = (comm.size * 4, 2)
    x = ref.a2a_input("out", comm.rank, comm.size, shape, "int32")
    out = np.full(shape, -1, np.int32)
    y = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all(x, comm=comm, algo=algo, out=out))
    if y is None:
        return
    assert y is out
    ref.assert_bitwise_equal(out, ref.a2a_expected("out", comm.rank, comm.size, shape, "int32"))


def test_all_to_all_out_torch(comm, torch):
    shape = (comm.size * 2, 3)
    x = ref.to_framework(ref.a2a_input("out-t", comm.rank, comm.size, shape, "bfloat16"), "bfloat16", "torch")
    out = torch.zeros(shape, dtype=torch.bfloat16)
    assert a2a.all_to_all(x, comm=comm, out=out) is out
    ref.assert_bitwise_equal(out, ref.a2a_expected("out-t", comm.rank, comm.size, shape, "bfloat16"))


def test_many_sizes_on_one_comm(comm):
    """The cached workspace grows and shrinks between calls without trouble."""
    algos = ALGOS if regular(comm) else ["linear"]
    results = []
    for i, per_peer in enumerate([1, 300, 2, 5000, 0, 17, 1000]):
        shape = (comm.size * per_peer, 3)
        x = ref.a2a_input(f"many{i}", comm.rank, comm.size, shape, "float32")
        for algo in algos:
            results.append((i, shape, algo, a2a.all_to_all(x, comm=comm, algo=algo)))
    for i, shape, algo, y in results:
        expected = ref.a2a_expected(f"many{i}", comm.rank, comm.size, shape, "float32")
        ref.assert_bitwise_equal(y, expected, f"{shape}, {algo}")


def test_mixed_frameworks_across_ranks(comm, torch):
    """Ranks may pass different frameworks: only bytes, dtype and count matter."""
    shape = (comm.size * 3,)
    x = ref.a2a_input("mixed", comm.rank, comm.size, shape, "float32")
    framework = "torch" if comm.rank % 2 else "numpy"
    y = a2a.all_to_all(ref.to_framework(x, "float32", framework), comm=comm)
    assert ref.framework_of(y) == framework
    ref.assert_bitwise_equal(y, ref.a2a_expected("mixed", comm.rank, comm.size, shape, "float32"))


def test_datatype_and_copy_comms_agree(comm, comm_copies):
    shape = (comm.size * 11, 7)
    x = ref.a2a_input("dt-copy", comm.rank, comm.size, shape, "uint8")
    ref.assert_bitwise_equal(a2a.all_to_all(x, comm=comm), a2a.all_to_all(x, comm=comm_copies))
