"""Bad input on a 1-rank communicator: the error class and what the message says.

Messages must name the operation, the rank, the shape/count and the dtype, so
each test asserts on that content, not just on the class.
"""

from __future__ import annotations

import numpy as np
import pytest
from checks import raises_invalid
from reference import UNSUPPORTED_NUMPY_DTYPES, assert_bitwise_equal

import a2a


def still_works(comm):
    """The comm is usable after a rejected call."""
    x = np.arange(6, dtype=np.int16).view(np.uint8)
    assert_bitwise_equal(a2a.all_to_all(x, comm=comm), x)


@pytest.mark.parametrize("dtype", UNSUPPORTED_NUMPY_DTYPES)
def test_unsupported_numpy_dtype(comm, dtype):
    """The reductions compute on the dtype: they take a2a's (the movement collectives move any number as
    bytes: tests/mpi/test_mpi_bytes.py)."""
    x = np.zeros((4, 2), dtype=dtype)
    message = raises_invalid(
        lambda: a2a.all_reduce(x, comm=comm),
        "all_reduce",
        "rank 0",
        "(4, 2)",
        dtype,
        "unsupported dtype",
        "float32",
    )
    assert "supported" in message
    still_works(comm)


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_flex", "all_to_all_v"])
def test_unsupported_dtype_every_collective(comm, op):
    x = np.zeros(3, dtype=object)  # no number: not even its bytes can move
    calls = {
        "all_to_all": lambda: a2a.all_to_all(x, comm=comm),
        "all_to_all_flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0),
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [3], comm=comm),
    }
    raises_invalid(calls[op], op, "rank 0 of 1", "object", "(3,)")


@pytest.mark.parametrize("dtype", ["complex64", "bool", "int16", "uint16"])
def test_unsupported_torch_dtype(comm, torch, dtype):
    x = torch.zeros(4, dtype=getattr(torch, dtype))
    raises_invalid(lambda: a2a.all_reduce(x, comm=comm), "all_reduce", "rank 0", "torch", dtype, "(4,)")


def test_torch_tensor_not_on_the_cpu(comm, torch):
    x = torch.empty(4, device="meta")
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm), "meta", "host or CUDA memory")


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(16, dtype=np.float32)[::2],
        lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,
        lambda: np.arange(24, dtype=np.int8).reshape(4, 6)[:, 1:3],
    ],
    ids=["strided", "transposed", "column-slice"],
)
def test_non_contiguous_numpy(comm, make):
    x = make()
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm), "not C-contiguous", str(x.shape), x.dtype.name, "rank 0")
    raises_invalid(
        lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0), "all_to_all_flex", "not C-contiguous"
    )
    raises_invalid(lambda: a2a.all_to_all_v(x, [x.shape[0]], comm=comm), "all_to_all_v", "not C-contiguous")
    still_works(comm)


def test_non_contiguous_torch(comm, torch):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm), "not C-contiguous", "torch", "(4, 3)", "float32")


def test_zero_dim_input(comm):
    x = np.float32(1.0).reshape(())
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm), "all_to_all", "rank 0", "dim 0", "()")
    raises_invalid(lambda: a2a.all_to_all_v(x, [1], comm=comm), "all_to_all_v", "0-d")
    raises_invalid(lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0), "out of range")


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_flex", "all_to_all_v"])
@pytest.mark.parametrize("algo", ["ring", "LINEAR", "", None, 1])
def test_unknown_algo(comm, op, algo):
    x = np.zeros(4, np.float32)
    calls = {
        "all_to_all": lambda: a2a.all_to_all(x, comm=comm, algo=algo),
        "all_to_all_flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0, algo=algo),
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [4], comm=comm, algo=algo),
    }
    raises_invalid(calls[op], op, "unknown algo", repr(algo), "linear", "2dh")
    still_works(comm)


def test_unknown_object(comm):
    raises_invalid(lambda: a2a.all_to_all([1.0, 2.0], comm=comm), "list", "rank 0")
    raises_invalid(lambda: a2a.all_to_all(object(), comm=comm), "object")


# ---------------------------------------------------------------------------
# out=


@pytest.fixture
def x():
    return np.arange(12, dtype=np.float32).reshape(6, 2)


@pytest.mark.parametrize(
    "make_out, fragments",
    [
        (lambda: np.empty((6, 3), np.float32), ["out has shape (6, 3)", "expected shape (6, 2)"]),
        (lambda: np.empty((12,), np.float32), ["(12,)", "(6, 2)"]),
        (lambda: np.empty((6, 2), np.float64), ["dtype float64", "dtype float32"]),
        (lambda: np.empty((6, 2), np.int32), ["int32", "float32"]),
        (lambda: np.empty((6, 4), np.float32)[:, ::2], ["not C-contiguous"]),
        (lambda: np.empty((6, 2), np.complex64), ["unsupported dtype"]),
        (lambda: [0.0] * 12, ["list"]),
    ],
    ids=["shape", "flat", "dtype", "int-dtype", "non-contiguous", "unsupported", "list"],
)
def test_bad_out(comm, x, make_out, fragments):
    for call, op in (
        (lambda out: a2a.all_to_all(x, comm=comm, out=out), "all_to_all"),
        (lambda out: a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=1, out=out), "all_to_all_flex"),
        (lambda out: a2a.all_to_all_v(x, [6], comm=comm, out=out), "all_to_all_v"),
    ):
        out = make_out()
        if op == "all_to_all_v":  # its rows are known only once they arrive
            fragments = [f.replace("expected shape (6, 2)", "expected shape (N, 2)") for f in fragments]
        raises_invalid(lambda call=call, out=out: call(out), op, "rank 0", "out", *fragments)
    still_works(comm)


def test_read_only_out(comm, x):
    out = np.empty_like(x)
    out.flags.writeable = False
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm, out=out), "out is read-only")


def test_out_of_another_framework(comm, torch, x):
    raises_invalid(
        lambda: a2a.all_to_all(x, comm=comm, out=torch.empty(6, 2)), "out is a torch array", "input is a numpy array"
    )
    t = torch.from_numpy(x.copy())
    raises_invalid(
        lambda: a2a.all_to_all(t, comm=comm, out=np.empty((6, 2), np.float32)), "out is a numpy array", "torch"
    )


def test_out_with_torch_dtype_mismatch(comm, torch):
    t = torch.zeros(4, dtype=torch.bfloat16)
    raises_invalid(lambda: a2a.all_to_all(t, comm=comm, out=torch.zeros(4, dtype=torch.float16)), "float16", "bfloat16")


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_flex", "all_to_all_v"])
def test_out_aliasing_the_input(comm, x, op):
    calls = {
        "all_to_all": lambda: a2a.all_to_all(x, comm=comm, out=x),
        "all_to_all_flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, out=x),
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [6], comm=comm, out=x),
    }
    raises_invalid(calls[op], op, "overlap")
    still_works(comm)


def test_out_partially_overlapping_the_input(comm):
    buf = np.arange(12, dtype=np.int32)
    raises_invalid(lambda: a2a.all_to_all(buf[:8], comm=comm, out=buf[4:]), "overlap")
    assert buf.tolist() == list(range(12)), "a rejected call must not write"


# ---------------------------------------------------------------------------
# flex axes


@pytest.mark.parametrize(
    "split, concat, bad",
    [(3, 0, "split_axis=3"), (0, 3, "concat_axis=3"), (-4, 0, "split_axis=-4"), (0, -4, "concat_axis=-4"),
     ("a", 0, "split_axis='a'"), (None, 0, "split_axis=None")],
)
def test_flex_axis_out_of_range(comm, split, concat, bad):
    x = np.zeros((2, 3, 4), np.float16)
    raises_invalid(
        lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=concat),
        "all_to_all_flex",
        "rank 0",
        bad,
        "out of range",
        "(2, 3, 4)",
        "float16",
    )
    still_works(comm)


# ---------------------------------------------------------------------------
# all_to_all_v counts


@pytest.mark.parametrize(
    "counts, fragments",
    [
        ([5], ["send_counts sum to 5 rows", "has 4 rows", "(4, 3)", "float64"]),
        ([3], ["sum to 3"]),
        ([-1], ["negative", "-1"]),
        ([2, 2], ["must be 1 integers", "[2, 2]"]),
        ([], ["must be 1 integers"]),
        ([4.0], ["integers"]),
        ([[4]], ["integers"]),
        (np.array([True]), ["integers"]),
        ("4", ["integers"]),
    ],
    ids=["too-many", "too-few", "negative", "wrong-length", "empty", "float", "2-d", "bool", "str"],
)
def test_v_bad_counts(comm, counts, fragments):
    x = np.zeros((4, 3), np.float64)
    raises_invalid(lambda: a2a.all_to_all_v(x, counts, comm=comm), "all_to_all_v", "rank 0 of 1", *fragments)
    still_works(comm)


def test_errors_are_value_errors(comm):
    with pytest.raises(ValueError):
        a2a.all_reduce(np.zeros(3, np.complex128), comm=comm)


@pytest.mark.parametrize("algo", [["linear"], {"2dh": 1}], ids=["list", "dict"])
def test_unhashable_algo_is_an_invalid_argument(comm, algo):
    """An unhashable algo must be reported like any unknown name (every rank has
    to learn about it), not escape as a local TypeError."""
    x = np.zeros(4, np.float32)
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm, algo=algo), "all_to_all", "unknown algo")


def test_flex_too_many_dims(comm):
    x = np.zeros((1,) * 17, np.float32)
    raises_invalid(lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0), "all_to_all_flex", "ndim", "17")
    still_works(comm)


def test_non_native_byte_order_is_rejected():
    """A byte-swapped array must not be read as the native dtype of the same name."""
    comm = a2a.Comm.from_mpi()
    swapped = np.arange(4, dtype=np.dtype(np.float32).newbyteorder())
    with pytest.raises(a2a.InvalidArgumentError, match="non-native byte order"):
        a2a.all_to_all(swapped, comm=comm)


def test_flex_axes_are_integers(comm):
    x = np.ones((2, 4), np.float32)
    for axis in (1.7, "1", True):
        raises_invalid(lambda axis=axis: a2a.all_to_all_flex(x, comm=comm, split_axis=axis, concat_axis=0),
                       "all_to_all_flex", f"split_axis={axis!r} is out of range: it takes an integer in [-2, 2)")
    assert a2a.all_to_all_flex(x, comm=comm, split_axis=np.int64(1), concat_axis=0).shape == (2, 4)
