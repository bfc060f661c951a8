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


def test_copy_ranges():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(30, np.uint8)
    _C.copy_ranges(CPU, dst.ctypes.data, src.ctypes.data, [(90, 0, 10), (0, 10, 0), (5, 10, 20)])
    np.testing.assert_array_equal(dst, np.concatenate([src[90:100], src[5:25]]))


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
