"""The layout kernels' C entry points on the CPU (a2a_transpose_chunks,
a2a_copy_ranges) against NumPy; tests/gpu/test_layout_gpu.py holds their
CUDA versions to these."""

from __future__ import annotations

import numpy as np
import pytest

import a2a
from a2a import _C

CPU = (0, 0, 0)


@pytest.mark.parametrize("rows,cols,chunk", [(1, 1, 1), (2, 3, 5), (4, 1, 16), (3, 7, 24), (0, 4, 8), (5, 5, 0)])
def test_transpose_chunks(rows, cols, chunk):
    src = np.arange(rows * cols * chunk, dtype=np.uint8)
    dst = np.zeros_like(src)
    _C.transpose_chunks(CPU, dst.ctypes.data, src.ctypes.data, rows, cols, chunk)
    want = src.reshape(rows, cols, chunk).transpose(1, 0, 2).reshape(-1)
    np.testing.assert_array_equal(dst, want)


# Above 1 MiB the CPU copies are cut into stretches for the thread pool; a
# stretch may start and end inside a chunk or a range.
@pytest.mark.parametrize("rows,cols,chunk", [(3, 5, 100_003), (1, 1, 3 << 20), (701, 3, 997), (2, 2, 1 << 20)])
def test_transpose_chunks_large(rows, cols, chunk):
    src = np.random.default_rng(rows).integers(0, 256, rows * cols * chunk, dtype=np.uint8)
    dst = np.zeros_like(src)
    _C.transpose_chunks(CPU, dst.ctypes.data, src.ctypes.data, rows, cols, chunk)
    np.testing.assert_array_equal(dst, src.reshape(rows, cols, chunk).transpose(1, 0, 2).reshape(-1))


def test_copy_ranges_large():
    """40 ranges of up to 200 KB, written to dst in the reverse of their order."""
    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(0, 200_000, 40)]
    src = rng.integers(0, 256, sum(sizes) + 1000, dtype=np.uint8)
    ranges, src_at, dst_at = [], 0, sum(sizes)
    for n in sizes:
        dst_at -= n
        ranges.append((src_at + int(rng.integers(0, 25)), dst_at, n))
        src_at += n
    dst = np.zeros(sum(sizes), np.uint8)
    _C.copy_ranges(CPU, dst.ctypes.data, src.ctypes.data, ranges)
    want = np.zeros_like(dst)
    for s, d, n in ranges:
        want[d : d + n] = src[s : s + n]
    np.testing.assert_array_equal(dst, want)


def test_copy_ranges():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(30, np.uint8)
    _C.copy_ranges(CPU, dst.ctypes.data, src.ctypes.data, [(90, 0, 10), (0, 10, 0), (5, 10, 20)])
    np.testing.assert_array_equal(dst, np.concatenate([src[90:100], src[5:25]]))


def test_copy_ranges_reads_an_array_of_ranges():
    """(n, 3) uint64 rows of (src offset, dst offset, bytes), as a list of triples gives them."""
    src = np.arange(100, dtype=np.uint8)
    table = np.array([(90, 0, 10), (0, 10, 0), (5, 10, 20)], dtype=np.uint64)
    from_table, from_list = np.zeros(30, np.uint8), np.zeros(30, np.uint8)
    _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, table)
    _C.copy_ranges(CPU, from_list.ctypes.data, src.ctypes.data, table.tolist())
    np.testing.assert_array_equal(from_table, np.concatenate([src[90:100], src[5:25]]))
    np.testing.assert_array_equal(from_list, from_table)
    _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, np.zeros((0, 3), np.uint64))  # nothing to copy
    with pytest.raises(ValueError, match=r"\(n, 3\) rows"):
        _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, table.reshape(-1))
    signed = table.astype(np.int64)
    _C.copy_ranges(CPU, from_list.ctypes.data, src.ctypes.data, signed)  # int64 without a negative entry
    np.testing.assert_array_equal(from_list, from_table)
    signed[2, 1] = -8  # a cast to uint64 would wrap it into an offset far outside dst
    with pytest.raises(ValueError, match=r"range 2 has a negative entry \(-8\)"):
        _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, signed)
    with pytest.raises(TypeError, match="must be uint64 or int64, got float64"):
        _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, table.astype(np.float64))
    for bad in ([(0.9, 0, 4)], [(0, -8, 4)], [(0, 0)]):
        with pytest.raises(TypeError, match="triples of non-negative integers"):
            _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, bad)
    with pytest.raises(ValueError, match="C-contiguous"):
        _C.copy_ranges(CPU, from_table.ctypes.data, src.ctypes.data, np.asfortranarray(np.tile(table, (1, 2)))[:, ::2])


def test_overlapping_buffers_are_rejected():
    buf = np.zeros(64, np.uint8)
    with pytest.raises(a2a.InvalidArgumentError, match="overlap"):
        _C.transpose_chunks(CPU, buf.ctypes.data + 8, buf.ctypes.data, 2, 2, 8)


def test_null_buffers_are_rejected():
    with pytest.raises(a2a.InvalidArgumentError, match="NULL"):
        _C.transpose_chunks(CPU, 0, 0, 2, 2, 8)
    with pytest.raises(a2a.InvalidArgumentError, match="NULL"):
        _C.copy_ranges(CPU, 0, 0, [(0, 0, 4)])


def test_cuda_without_a_gpu_is_unsupported():
    if not a2a.config()["cuda"]:
        pytest.skip("built without CUDA")
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present (tests/gpu covers it)")
    except ImportError:
        pass
    with pytest.raises(a2a.UnsupportedError):
        _C.transpose_chunks((1, 0, 0), 16, 64, 1, 1, 8)
