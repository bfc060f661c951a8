"""all_gather_v and reduce_scatter_v on a 1-rank communicator: each is a copy
of its input there, so dtypes, frameworks, count types and out= are checked
exactly; and every argument check, the Python layer's and the core's (reached
through the native binding), with what its message says.
tests/mpi/test_mpi_dense_v.py checks the exchanges and the cross-rank errors."""

from __future__ import annotations

import numpy as np
import pytest
from checks import raises_invalid
from reference import ALL_DTYPES, assert_bitwise_equal, block, dtype_name, framework_of, to_framework

import a2a
from a2a._arrays import NUMPY_CODES

OPS = {
    "all_gather_v": lambda x, counts, comm, **kw: a2a.all_gather_v(x, counts, comm=comm, **kw),
    "reduce_scatter_v": lambda x, counts, comm, **kw: a2a.reduce_scatter_v(x, counts, comm=comm, **kw),
}
FLOAT64 = NUMPY_CODES[np.dtype(np.float64)]


def data(shape, dtype, framework="numpy"):
    return to_framework(block("dense-v", 0, 0, shape, dtype), dtype, framework)


def still_works(comm):
    x = np.arange(6.0).reshape(3, 2)
    assert_bitwise_equal(a2a.all_gather_v(x, [3], comm=comm), x)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (5,), (0, 3), (7, 3), (2, 2, 3)], ids=str)
def test_one_rank_is_a_copy(comm, name, dtype, shape):
    framework = "numpy"
    if dtype == "bfloat16":
        pytest.importorskip("torch")
        framework = "torch"
    x = data(shape, dtype, framework)
    y = OPS[name](x, [shape[0]], comm)
    assert framework_of(y) == framework and dtype_name(y) == dtype
    if shape[0] != 0:  # raw_bytes cannot view an empty bfloat16 tensor
        assert_bitwise_equal(y, x)
    assert tuple(y.shape) == shape


@pytest.mark.parametrize(
    "make_counts",
    [
        lambda n: [n],
        lambda n: (n,),
        lambda n: np.array([n], dtype=np.int32),
        lambda n: np.array([n], dtype=np.uint64),
        lambda n: [np.int64(n)],
    ],
    ids=["list", "tuple", "int32", "uint64", "np-int64-list"],
)
def test_counts_types(comm, make_counts):
    x = data((3, 2), "float32")
    for name, op in OPS.items():
        assert_bitwise_equal(op(x, make_counts(3), comm), x, name)


def test_torch_tensors_and_counts(comm, torch):
    x = data((4, 3), "int64", "torch")
    for name, op in OPS.items():
        y = op(x, torch.tensor([4]), comm)
        assert isinstance(y, torch.Tensor), name
        assert_bitwise_equal(y, x, name)


def test_out(comm):
    x = data((4, 2), "int32")
    for name, op in OPS.items():
        out = np.zeros((4, 2), np.int32)
        assert op(x, [4], comm, out=out) is out, name
        assert_bitwise_equal(out, x, name)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reductions_of_one_rank(comm, op):
    x = data((3, 2), "float64")
    assert_bitwise_equal(a2a.reduce_scatter_v(x, [3], comm=comm, op=op), x)


# ---------------------------------------------------------------------------
# Errors of the Python layer


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize(
    "counts, fragments",
    [
        ([-1], ["counts has negative entries", "[-1]"]),
        ([2, 2], ["counts must be 1 integers", "[2, 2]"]),
        ([], ["counts must be 1 integers"]),
        ([4.0], ["integers"]),
        ([[4]], ["integers"]),
        (np.array([True]), ["integers"]),
        ("4", ["integers"]),
        ([2**62 + 1], ["above"]),
    ],
    ids=["negative", "wrong-length", "empty", "float", "2-d", "bool", "str", "huge"],
)
def test_bad_counts(comm, name, counts, fragments):
    x = np.zeros((4, 3), np.float64)
    raises_invalid(lambda: OPS[name](x, counts, comm), name, "rank 0 of 1", *fragments)
    still_works(comm)


def test_rows_do_not_match_the_counts(comm):
    x = np.zeros((4, 3), np.float32)
    raises_invalid(
        lambda: a2a.all_gather_v(x, [5], comm=comm), "all_gather_v", "rank 0 of 1", "(4, 3)", "float32",
        "has 4 rows but counts[0] is 5",
    )
    raises_invalid(
        lambda: a2a.reduce_scatter_v(x, [3], comm=comm), "reduce_scatter_v", "has 4 rows but counts sum to 3"
    )
    still_works(comm)


def test_elements_overflow(comm):
    x = np.zeros((0, 2**31))  # rows of 2^31 elements, and no memory
    raises_invalid(lambda: a2a.all_gather_v(x, [2**32], comm=comm), "all_gather_v", "rows of 2147483648 elements overflow")


def test_unknown_op_and_dtype(comm):
    x = np.zeros(3)
    raises_invalid(lambda: a2a.reduce_scatter_v(x, [3], comm=comm, op="prod"), "reduce_scatter_v", "unknown op 'prod'")
    raises_invalid(
        lambda: a2a.all_gather_v(np.zeros(3, object), [3], comm=comm), "all_gather_v", "object", "(3,)"
    )
    raises_invalid(lambda: a2a.all_gather_v(np.float64(1.0), [1], comm=comm), "all_gather_v", "0-d")


def test_out_of_the_wrong_shape(comm):
    x = np.zeros((4, 2))
    raises_invalid(
        lambda: a2a.reduce_scatter_v(x, [4], comm=comm, out=np.zeros((3, 2))), "reduce_scatter_v", "out has shape (3, 2)"
    )
    raises_invalid(lambda: a2a.all_gather_v(x, [4], comm=comm, out=x), "all_gather_v", "overlap")
    still_works(comm)


def test_comm_must_be_a_comm():
    for op in OPS.values():
        with pytest.raises(TypeError, match="comm must be an a2a.Comm"):
            op(np.zeros(2), [2], None)
        with pytest.raises(TypeError, match="comm must be an a2a.Comm"):
            op(np.zeros(2), [2], "world")


# ---------------------------------------------------------------------------
# The core's checks, through the native binding


def test_core_rejects_negative_counts(comm):
    x, y = np.zeros(4), np.zeros(4)
    raises_invalid(
        lambda: comm._native.all_gather_v(x.ctypes.data, y.ctypes.data, [-2], FLOAT64),
        "all_gather_v on rank 0 of 1", "counts[0] is negative (-2)",
    )
    still_works(comm)


def test_core_counts_list_of_another_length(comm):
    x, y = np.zeros(4), np.zeros(4)
    raises_invalid(
        lambda: comm._native.reduce_scatter_v(x.ctypes.data, y.ctypes.data, [2, 2], FLOAT64, 0),
        "reduce_scatter_v on rank 0 of 1", "counts has 2 entries; pass one per rank",
    )
    still_works(comm)


def test_core_buffer_checks(comm):
    x = np.zeros(8)
    native = comm._native
    raises_invalid(lambda: native.all_gather_v(0, x.ctypes.data, [4], FLOAT64), "send buffer is NULL but holds 32 bytes")
    raises_invalid(
        lambda: native.reduce_scatter_v(x.ctypes.data, 0, [4], FLOAT64, 0), "recv buffer is NULL but must hold 32 bytes"
    )
    raises_invalid(
        lambda: native.reduce_scatter_v(x.ctypes.data, x.ctypes.data + 8, [4], FLOAT64, 0),
        "reduce_scatter_v on rank 0 of 1", "overlap",
    )
    # Empty blocks need no buffers.
    native.all_gather_v(0, 0, [0], FLOAT64)
    native.reduce_scatter_v(0, 0, [0], FLOAT64, 0)
    still_works(comm)


def test_core_rejects_unknown_codes(comm):
    x, y = np.zeros(2), np.zeros(2)
    raises_invalid(
        lambda: comm._native.reduce_scatter_v(x.ctypes.data, y.ctypes.data, [2], FLOAT64, 7),
        "unknown reduction code 7", "sum, max, min",
    )
    raises_invalid(
        lambda: comm._native.all_gather_v(x.ctypes.data, y.ctypes.data, [2], 99), "unsupported dtype code 99"
    )
    raises_invalid(
        lambda: comm._native.all_gather_v(x.ctypes.data, y.ctypes.data, [2**62], FLOAT64), "counts[0]", "overflows"
    )
    still_works(comm)
