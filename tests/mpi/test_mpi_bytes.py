"""The movement collectives on dtypes a2a's kernels do not take (a2a/_bytes.py):
bool, int16, complex and float8, torch and NumPy, moved as
their elements' bytes and given back in their dtype, bitwise against NumPy's
reference on those bytes; odd counts, negative axes, out=. The reductions
still refuse them, and an out= of another dtype fails on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref

import a2a

CASES = [("torch", "bool"), ("torch", "complex64"), ("torch", "float8_e4m3fn"), ("numpy", "int16"),
         ("numpy", "complex128")]  # 1, 8, 1, 2 and 16 bytes an element


def itemsize(framework: str, dtype: str) -> int:
    if framework == "numpy":
        return np.dtype(dtype).itemsize
    torch = pytest.importorskip("torch")
    return getattr(torch, dtype).itemsize


def raw(tag: str, rank: int, shape: tuple[int, ...], framework: str, dtype: str) -> np.ndarray:
    """Rank `rank`'s elements as bytes, (*shape, itemsize) uint8: random, 0 or 1 for bool."""
    seed = sum(ord(c) for c in tag) * 1009 + rank
    data = np.random.default_rng(seed).integers(0, 256, size=(*shape, itemsize(framework, dtype)), dtype=np.uint8)
    return data % 2 if dtype == "bool" else data


def array_of(data: np.ndarray, framework: str, dtype: str):
    if framework == "numpy":
        return data.view(np.dtype(dtype)).reshape(data.shape[:-1])
    torch = pytest.importorskip("torch")
    return torch.from_numpy(data.copy()).flatten(-2).view(getattr(torch, dtype))


def bytes_of(result, framework: str, dtype: str) -> np.ndarray:
    size = itemsize(framework, dtype)
    if framework == "numpy":
        assert result.dtype == np.dtype(dtype)
        return result.view(np.uint8).reshape(*result.shape, size)
    torch = pytest.importorskip("torch")
    assert result.dtype == getattr(torch, dtype)
    return result.view(torch.uint8).numpy().reshape(*result.shape, size)


@pytest.mark.parametrize("framework, dtype", CASES)
def test_all_to_all_and_all_gather(comm, framework, dtype):
    world = comm.size
    inputs = [raw("a2a", r, (3 * world, 5), framework, dtype) for r in range(world)]
    x = array_of(inputs[comm.rank], framework, dtype)
    np.testing.assert_array_equal(bytes_of(a2a.all_to_all(x, comm=comm), framework, dtype),
                                  ref.ref_all_to_all(inputs)[comm.rank])
    out = array_of(np.zeros_like(inputs[comm.rank]), framework, dtype)
    assert a2a.all_to_all(x, comm=comm, algo="2dh" if not comm.irregular_reason else "linear", out=out) is out
    np.testing.assert_array_equal(bytes_of(out, framework, dtype), ref.ref_all_to_all(inputs)[comm.rank])
    np.testing.assert_array_equal(bytes_of(a2a.all_gather(x, comm=comm), framework, dtype), np.concatenate(inputs))


@pytest.mark.parametrize("framework, dtype", CASES)
@pytest.mark.parametrize("split_axis, concat_axis", [(0, -1), (-2, -3)])
def test_all_to_all_flex_with_negative_axes(comm, framework, dtype, split_axis, concat_axis):
    world = comm.size
    inputs = [raw("flex", r, (2 * world, 3 * world, 2 * world), framework, dtype) for r in range(world)]
    x = array_of(inputs[comm.rank], framework, dtype)
    got = a2a.all_to_all_flex(x, comm=comm, split_axis=split_axis, concat_axis=concat_axis)
    # the axes of the bytes arrays: the elements' axes from the front, the bytes' last
    want = ref.ref_all_to_all_flex(inputs, split_axis % 3, concat_axis % 3)[comm.rank]
    np.testing.assert_array_equal(bytes_of(got, framework, dtype), want)


@pytest.mark.parametrize("framework, dtype", CASES)
def test_the_uneven_ones_with_odd_counts(comm, framework, dtype):
    world = comm.size
    counts = np.array([[(3 * src + dst) % 4 for dst in range(world)] for src in range(world)])
    inputs = [raw("v", r, (int(counts[r].sum()), 3), framework, dtype) for r in range(world)]
    x = array_of(inputs[comm.rank], framework, dtype)
    received, received_counts = a2a.all_to_all_v(x, counts[comm.rank], comm=comm)
    want, want_counts = ref.ref_all_to_all_v(inputs, counts)[comm.rank]
    np.testing.assert_array_equal(bytes_of(received, framework, dtype), want)
    assert received_counts.tolist() == want_counts.tolist()
    rows = [(2 * r + 1) % 5 for r in range(world)]
    gathered = [raw("agv", r, (rows[r], 2), framework, dtype) for r in range(world)]
    got = a2a.all_gather_v(array_of(gathered[comm.rank], framework, dtype), rows, comm=comm)
    np.testing.assert_array_equal(bytes_of(got, framework, dtype), np.concatenate(gathered))


def test_reductions_refuse_them_and_an_out_of_another_dtype_fails_on_every_rank(comm):
    torch = pytest.importorskip("torch")
    x = torch.ones(2 * comm.size, 3, dtype=torch.int16)
    if comm.size > 1:  # an error about the bytes says whose they are
        odd = torch.ones(2 * comm.size, comm.size + 1, dtype=torch.int16)
        with pytest.raises(a2a.A2AError, match=rf"dimension 1 \({comm.size + 1}\) .*the input: Tensor of shape "
                           rf"\({2 * comm.size}, {comm.size + 1}\) and dtype torch.int16, moved as its bytes"):
            a2a.all_to_all_flex(odd, comm=comm, split_axis=1, concat_axis=0)
    with pytest.raises(a2a.A2AError, match="unsupported dtype"):
        a2a.all_reduce(x, comm=comm)
    with pytest.raises(a2a.A2AError, match="out must be a C-contiguous Tensor of the input's dtype torch.int16"):
        a2a.all_to_all(x, comm=comm, out=torch.empty(2 * comm.size, 3, dtype=torch.uint16))
    assert torch.equal(a2a.all_to_all(x, comm=comm), x)  # the communicator still works
