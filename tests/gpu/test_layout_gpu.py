"""The CUDA layout kernels (transpose_chunks: the 2DH stride copy and the
flexible all-to-all's layout change; copy_ranges: 2DH all-to-all-v) against
their CPU twins, bitwise, for chunk sizes and alignments that take every
vector width, and the scalar tail."""

from __future__ import annotations

import numpy as np
import pytest

from a2a import _C

torch = pytest.importorskip("torch")

CPU = (0, 0, 0)  # a2a_exec_t as (device_type, stream, num_threads)


def cuda_exec() -> tuple[int, int, int]:
    return (1, torch.cuda.current_stream().cuda_stream, 0)


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 3), (4, 4), (7, 5), (1, 64), (300, 257)])
@pytest.mark.parametrize("chunk_bytes", [1, 3, 8, 16, 24, 100, 4096, 65536 + 48])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 3), (8, 0), (4, 12)], ids=lambda o: f"src+{o[0]},dst+{o[1]}")
def test_transpose_chunks_matches_cpu(rows, cols, chunk_bytes, offsets):
    total = rows * cols * chunk_bytes
    if total > 64 << 20:
        pytest.skip("large")
    src_off, dst_off = offsets
    src = random_bytes(total + src_off, rows * 1000 + cols * 10 + chunk_bytes)
    want = np.zeros(total + dst_off, np.uint8)
    _C.transpose_chunks(CPU, want.ctypes.data + dst_off, src.ctypes.data + src_off, rows, cols, chunk_bytes)
    src_gpu = torch.from_numpy(src).cuda()
    got = torch.zeros(total + dst_off, dtype=torch.uint8, device="cuda")
    _C.transpose_chunks(cuda_exec(), got.data_ptr() + dst_off, src_gpu.data_ptr() + src_off, rows, cols, chunk_bytes)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_transpose_chunks_with_more_than_65535_chunks():
    rows, cols, chunk = 70000, 3, 16
    src = random_bytes(rows * cols * chunk, 7)
    want = np.zeros_like(src)
    _C.transpose_chunks(CPU, want.ctypes.data, src.ctypes.data, rows, cols, chunk)
    src_gpu = torch.from_numpy(src).cuda()
    got = torch.empty_like(src_gpu)
    _C.transpose_chunks(cuda_exec(), got.data_ptr(), src_gpu.data_ptr(), rows, cols, chunk)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(got.cpu().numpy(), want)


# 1023 ranges fit one launch with CUDA >= 12.1 (layout_cuda.cu), 120 before: 2500 takes several either way.
@pytest.mark.parametrize("count", [0, 1, 5, 129, 400, 1024, 2500])
def test_copy_ranges_matches_cpu(count):
    rng = np.random.default_rng(count)
    sizes = rng.choice([0, 1, 7, 16, 33, 4096, 100_000], size=count)
    src_offsets = np.concatenate([[0], np.cumsum(sizes + rng.integers(0, 17, size=count))])[:-1]
    dst_offsets = np.zeros(count, np.int64)  # disjoint, in a shuffled order
    position = 0
    for j in rng.permutation(count):
        dst_offsets[j] = position
        position += sizes[j]
    ranges = [(int(s), int(d), int(n)) for s, d, n in zip(src_offsets, dst_offsets, sizes)]
    src_total = int(max((s + n for s, _, n in ranges), default=1))
    dst_total = int(max(sum(int(n) for n in sizes), 1))
    src = random_bytes(src_total, count)
    want = np.zeros(dst_total, np.uint8)
    _C.copy_ranges(CPU, want.ctypes.data, src.ctypes.data, ranges)
    src_gpu = torch.from_numpy(src).cuda()
    got = torch.zeros(dst_total, dtype=torch.uint8, device="cuda")
    _C.copy_ranges(cuda_exec(), got.data_ptr(), src_gpu.data_ptr(), ranges)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(got.cpu().numpy(), want)
