"""The collectives on a 1-rank communicator: shapes, dtypes, frameworks, out=.

With one rank every collective is a copy, which makes the array handling
(dtype, layout, framework, out=) easy to check exactly.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
from reference import (
    ALL_DTYPES,
    NUMPY_DTYPES,
    assert_bitwise_equal,
    block,
    dtype_name,
    framework_of,
    ref_all_to_all_flex,
    to_framework,
)

import a2a

ALGOS = ["linear", "2dh"]
SHAPES = [(0,), (1,), (7,), (13, 3), (5, 0, 2), (2, 3, 4, 5)]


def data(shape, dtype, framework="numpy", tag="single"):
    return to_framework(block(tag, 0, 0, shape, dtype), dtype, framework)


# ---------------------------------------------------------------------------
# all_to_all


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_all_to_all_numpy(comm, algo, dtype, shape):
    x = data(shape, dtype)
    before = x.copy()
    y = a2a.all_to_all(x, comm=comm, algo=algo)
    assert isinstance(y, np.ndarray)
    assert y.dtype == x.dtype
    assert_bitwise_equal(y, x)
    assert not np.shares_memory(x, y), "the output must be a new array"
    assert_bitwise_equal(x, before, "input after the call")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(0, 4), (6,), (3, 5)], ids=str)
def test_all_to_all_torch(comm, torch, algo, dtype, shape):
    x = data(shape, dtype, "torch")
    y = a2a.all_to_all(x, comm=comm, algo=algo)
    assert isinstance(y, torch.Tensor), f"output is a {type(y).__name__}, expected a torch tensor"
    assert y.dtype == x.dtype
    assert y.device.type == "cpu"
    assert y.data_ptr() != x.data_ptr() or x.numel() == 0
    assert_bitwise_equal(y, x)


@pytest.mark.parametrize("algo", ALGOS)
def test_all_to_all_out(comm, algo):
    x = data((6, 2), "float64")
    out = np.full((6, 2), -1.0)
    y = a2a.all_to_all(x, comm=comm, algo=algo, out=out)
    assert y is out
    assert_bitwise_equal(out, x)


def test_all_to_all_out_torch(comm, torch):
    x = data((4, 3), "bfloat16", "torch")
    out = torch.zeros(4, 3, dtype=torch.bfloat16)
    y = a2a.all_to_all(x, comm=comm, out=out)
    assert y is out
    assert_bitwise_equal(out, x)


def test_all_to_all_repeated_calls_reuse_the_comm(comm):
    for n in (1, 1000, 3, 100000, 0, 17):
        x = data((n,), "int32", tag=f"repeat{n}")
        assert_bitwise_equal(a2a.all_to_all(x, comm=comm, algo="2dh" if n % 2 else "linear"), x)


def test_dlpack_input(comm):
    class DLPackOnly:
        """Exports DLPack and nothing else (no buffer protocol, not an ndarray)."""

        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kwargs):
            return self._a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    x = data((4, 3), "int64")
    y = a2a.all_to_all(DLPackOnly(x), comm=comm)
    assert isinstance(y, np.ndarray)
    assert y.dtype == np.int64
    assert_bitwise_equal(y, x)


def test_buffer_protocol_input(comm):
    buf = bytearray(range(12))
    y = a2a.all_to_all(buf, comm=comm)
    assert isinstance(y, np.ndarray) and y.dtype == np.uint8
    assert bytes(y) == bytes(buf)
    arr = array.array("d", [1.5, -2.0, 3.25])
    y = a2a.all_to_all(arr, comm=comm)
    assert y.dtype == np.float64 and y.tolist() == [1.5, -2.0, 3.25]


def test_read_only_input_is_fine(comm):
    x = data((8,), "float32")
    x.flags.writeable = False
    assert_bitwise_equal(a2a.all_to_all(x, comm=comm), x)


def test_torch_tensor_requiring_grad(comm, torch):
    """A tensor that requires grad records autograd (a2a.torch; its tests are
    in test_torch_collectives.py); without grad mode the output is a plain tensor."""
    x = torch.arange(6, dtype=torch.float32).requires_grad_()
    y = a2a.all_to_all(x, comm=comm)
    assert y.requires_grad
    assert torch.equal(y.detach(), x.detach())
    with torch.no_grad():
        y = a2a.all_to_all(x, comm=comm)
    assert not y.requires_grad
    assert torch.equal(y, x.detach())


# ---------------------------------------------------------------------------
# all_to_all_flex


FLEX_CASES = [
    ((4, 3, 5), 0, 1),
    ((2, 6, 5), 1, 0),
    ((3, 4), 0, 0),
    ((3, 4), 1, 1),
    ((3, 2, 6), -1, -3),
    ((2, 1, 3, 4), 3, 0),
    ((7,), 0, -1),
    ((0, 4), 1, 0),
    ((4, 0), 0, 1),
]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", ["float32", "int8", "float16", "int64"])
@pytest.mark.parametrize("shape, split, concat", FLEX_CASES, ids=str)
def test_flex_single_rank(comm, comm_copies, algo, dtype, shape, split, concat):
    x = data(shape, dtype)
    expected = ref_all_to_all_flex([x], split % len(shape), concat % len(shape))[0]
    for c in (comm, comm_copies):
        y = a2a.all_to_all_flex(x, comm=c, split_axis=split, concat_axis=concat, algo=algo)
        assert isinstance(y, np.ndarray)
        assert_bitwise_equal(y, expected)


def test_flex_torch(comm, torch):
    x = data((4, 6, 2), "bfloat16", "torch")
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert_bitwise_equal(y, x)


def test_flex_out(comm):
    x = data((2, 3, 4), "uint8")
    out = np.zeros((2, 3, 4), np.uint8)
    assert a2a.all_to_all_flex(x, comm=comm, split_axis=2, concat_axis=0, out=out) is out
    assert_bitwise_equal(out, x)


def test_flex_accepts_numpy_integer_axes(comm):
    x = data((2, 3), "float32")
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=np.int64(1), concat_axis=np.int32(0))
    assert_bitwise_equal(y, x)


# ---------------------------------------------------------------------------
# all_to_all_v


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (5,), (0, 3), (7, 3), (2, 2, 3)], ids=str)
def test_v_single_rank(comm, algo, dtype, shape):
    x = data(shape, dtype)
    y, counts = a2a.all_to_all_v(x, [shape[0]], comm=comm, algo=algo)
    assert isinstance(y, np.ndarray)
    assert_bitwise_equal(y, x)
    assert isinstance(counts, np.ndarray) and counts.dtype == np.int64
    assert counts.tolist() == [shape[0]]


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
def test_v_counts_types(comm, make_counts):
    x = data((3, 2), "float32")
    y, counts = a2a.all_to_all_v(x, make_counts(3), comm=comm)
    assert_bitwise_equal(y, x)
    assert counts.tolist() == [3]


def test_v_torch(comm, torch):
    for dtype in ("float32", "bfloat16", "int64"):
        x = data((5, 3), dtype, "torch")
        y, counts = a2a.all_to_all_v(x, torch.tensor([5]), comm=comm, algo="2dh")
        assert isinstance(y, torch.Tensor), dtype
        assert dtype_name(y) == dtype
        assert_bitwise_equal(y, x)
        assert isinstance(counts, np.ndarray) and counts.tolist() == [5]


def test_v_out(comm):
    x = data((4, 2), "int32")
    out = np.zeros((4, 2), np.int32)
    y, _ = a2a.all_to_all_v(x, [4], comm=comm, out=out)
    assert y is out
    assert_bitwise_equal(out, x)


def test_output_framework_follows_input(comm, torch):
    for framework in ("numpy", "torch"):
        x = data((4,), "float32", framework)
        assert framework_of(a2a.all_to_all(x, comm=comm)) == framework
        assert framework_of(a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0)) == framework
        assert framework_of(a2a.all_to_all_v(x, [4], comm=comm)[0]) == framework
