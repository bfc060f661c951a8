"""Plain-NumPy reference for the a2a collectives, and deterministic test data.

Every rank's input is a function of (tag, source rank, destination rank,
shape, dtype) only, so each rank can build any other rank's input, or just the
blocks it is going to receive, without communicating. Data are random bytes:
float blocks contain NaNs, infinities and subnormals on purpose, and every
comparison is bitwise (on the raw bytes), never numeric.

bfloat16 exists only in torch here; its NumPy storage is int16 (same bits).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

SEED = 20240229

NUMPY_DTYPES = ("float32", "float64", "float16", "int8", "int32", "int64", "uint8")
ALL_DTYPES = (*NUMPY_DTYPES, "bfloat16")
# Supported by neither the library nor its error messages' "supported" list.
UNSUPPORTED_NUMPY_DTYPES = ("complex64", "complex128", "bool", "uint16", "uint32", "uint64", "int16")


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype that stores `dtype`'s bits (int16 for bfloat16)."""
    return np.dtype("int16") if dtype == "bfloat16" else np.dtype(dtype)


def itemsize(dtype: str) -> int:
    return storage_dtype(dtype).itemsize


def _key(tag: str, *numbers: int) -> list[int]:
    return [SEED, zlib.crc32(tag.encode()), *(int(n) for n in numbers)]


def block(tag: str, src: int, dst: int, shape: Sequence[int], dtype: str) -> np.ndarray:
    """The deterministic block that rank `src` sends to rank `dst` (NumPy
    storage dtype, C-contiguous, writable)."""
    shape = tuple(int(s) for s in shape)
    dt = storage_dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.random.default_rng(_key(tag, src, dst, *shape)).bytes(nbytes)
    return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)


def block_shape(shape: Sequence[int], split_axis: int, world: int) -> tuple[int, ...]:
    b = list(shape)
    if b[split_axis] % world:
        raise ValueError(f"dimension {split_axis} of {tuple(shape)} is not divisible by {world}")
    b[split_axis] //= world
    return tuple(b)


# ---------------------------------------------------------------------------
# Inputs and expected outputs computed block by block (cheap: a rank builds
# only its own input and the blocks it receives).


def flex_input(tag: str, rank: int, world: int, shape: Sequence[int], split_axis: int, dtype: str) -> np.ndarray:
    """Rank `rank`'s input of `shape`: block i along split_axis goes to rank i."""
    bshape = block_shape(shape, split_axis, world)
    blocks = [block(tag, rank, i, bshape, dtype) for i in range(world)]
    return np.ascontiguousarray(np.concatenate(blocks, axis=split_axis))


def flex_expected(
    tag: str, rank: int, world: int, shape: Sequence[int], split_axis: int, concat_axis: int, dtype: str
) -> np.ndarray:
    """What rank `rank` must receive: block `rank` of every source, concatenated
    along concat_axis in source-rank order."""
    bshape = block_shape(shape, split_axis, world)
    blocks = [block(tag, j, rank, bshape, dtype) for j in range(world)]
    return np.ascontiguousarray(np.concatenate(blocks, axis=concat_axis))


def a2a_input(tag: str, rank: int, world: int, shape: Sequence[int], dtype: str) -> np.ndarray:
    """all_to_all input (split along dim 0)."""
    return flex_input(tag, rank, world, shape, 0, dtype)


def a2a_expected(tag: str, rank: int, world: int, shape: Sequence[int], dtype: str) -> np.ndarray:
    return flex_expected(tag, rank, world, shape, 0, 0, dtype)


# all_to_all_v: counts[src][dst] rows go from src to dst.

V_PATTERNS = ("varied", "zero_to_next", "empty_odd_ranks", "all_zero", "only_to_rank0", "odd_large")


def v_counts(pattern: str, world: int) -> np.ndarray:
    """A (world, world) int64 matrix: counts[src][dst] rows from src to dst."""
    c = np.zeros((world, world), dtype=np.int64)
    for s in range(world):
        for d in range(world):
            if pattern == "varied":
                c[s, d] = (3 * s + 5 * d + 1) % 4  # includes zeros
            elif pattern == "zero_to_next":
                c[s, d] = 0 if d == (s + 1) % world else 1 + (s + 2 * d) % 3
            elif pattern == "empty_odd_ranks":
                c[s, d] = 0 if s % 2 else 2 + d % 2  # odd ranks send nothing at all
            elif pattern == "all_zero":
                c[s, d] = 0
            elif pattern == "only_to_rank0":
                c[s, d] = s + 1 if d == 0 else 0
            elif pattern == "odd_large":
                c[s, d] = 7 + 2 * ((s + d) % 3)  # 7, 9, 11
            else:
                raise ValueError(pattern)
    return c


def v_input(tag: str, rank: int, counts: np.ndarray, row_shape: Sequence[int], dtype: str) -> np.ndarray:
    world = counts.shape[0]
    blocks = [block(tag, rank, d, (counts[rank, d], *row_shape), dtype) for d in range(world)]
    return np.ascontiguousarray(np.concatenate(blocks, axis=0))


def v_expected(
    tag: str, rank: int, counts: np.ndarray, row_shape: Sequence[int], dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """(recv, recv_counts) of rank `rank`."""
    world = counts.shape[0]
    blocks = [block(tag, s, rank, (counts[s, rank], *row_shape), dtype) for s in range(world)]
    return np.ascontiguousarray(np.concatenate(blocks, axis=0)), counts[:, rank].astype(np.int64)


# ---------------------------------------------------------------------------
# Whole-world references: from every rank's full input to every rank's output,
# written independently of the block construction above (np.split based).


def ref_all_to_all_flex(inputs: Sequence[np.ndarray], split_axis: int, concat_axis: int) -> list[np.ndarray]:
    """JAX lax.all_to_all over a simulated world: inputs[r] is rank r's array."""
    world = len(inputs)
    pieces = [np.split(x, world, axis=split_axis) for x in inputs]
    return [
        np.ascontiguousarray(np.concatenate([pieces[src][dst] for src in range(world)], axis=concat_axis))
        for dst in range(world)
    ]


def ref_all_to_all(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """MPI_Alltoall along dim 0."""
    return ref_all_to_all_flex(inputs, 0, 0)


def ref_all_to_all_v(inputs: Sequence[np.ndarray], counts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """MPI_Alltoallv along dim 0: counts[src][dst] rows, packed in rank order."""
    world = len(inputs)
    pieces = [np.split(x, np.cumsum(counts[src])[:-1], axis=0) for src, x in enumerate(inputs)]
    return [
        (
            np.ascontiguousarray(np.concatenate([pieces[src][dst] for src in range(world)], axis=0)),
            np.asarray([counts[src][dst] for src in range(world)], dtype=np.int64),
        )
        for dst in range(world)
    ]


def ref_flex_by_transpose(x_world: Sequence[np.ndarray], split_axis: int, concat_axis: int) -> list[np.ndarray]:
    """A second formulation, by moving axes: stack all ranks' inputs on a new
    leading source axis, split the split axis into (world, n), pick the
    destination, and merge the source axis into the concat axis (source-major)."""
    world = len(x_world)
    g = np.stack(x_world)  # [src, *shape]
    shape = list(g.shape[1:])
    s = split_axis + 1
    n = shape[split_axis] // world
    g = g.reshape(g.shape[:s] + (world, n) + g.shape[s + 1 :])  # [src, ..., dst, n, ...]
    new_shape = list(shape)
    new_shape[split_axis] = n
    new_shape[concat_axis] *= world
    out = []
    for dst in range(world):
        h = np.take(g, dst, axis=s)  # [src, *block shape]
        h = np.moveaxis(h, 0, concat_axis)  # src right before the block's concat dim
        out.append(np.ascontiguousarray(h.reshape(new_shape)))
    return out


# ---------------------------------------------------------------------------
# Frameworks and bitwise comparison.


def to_framework(a: np.ndarray, dtype: str, framework: str) -> Any:
    """A writable, C-contiguous array of `dtype` in `framework`, holding a's bits."""
    a = np.ascontiguousarray(a)
    if framework == "numpy":
        if dtype == "bfloat16":
            raise ValueError("bfloat16 needs torch")
        return a.view(np.dtype(dtype))
    if framework == "torch":
        import torch

        if not a.flags.writeable:
            a = a.copy()
        return torch.from_numpy(a.view(storage_dtype(dtype))).view(getattr(torch, dtype))
    raise ValueError(framework)


def framework_of(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return "numpy"
    if type(a).__module__.startswith("torch"):
        return "torch"
    return type(a).__name__


def dtype_name(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return a.dtype.name
    return str(a.dtype).removeprefix("torch.")


def raw_bytes(a: Any) -> np.ndarray:
    """The bytes of `a` in C order, as a 1-D uint8 NumPy array."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    t = a.detach().cpu().contiguous().reshape(-1)
    import torch

    return t.view(torch.uint8).numpy()


def assert_bitwise_equal(actual: Any, expected: Any, what: str = "result") -> None:
    """Shapes equal and every byte equal (NaN payloads and -0.0 included)."""
    a_shape, e_shape = tuple(actual.shape), tuple(expected.shape)
    assert a_shape == e_shape, f"{what}: shape {a_shape} != expected {e_shape}"
    a, e = raw_bytes(actual), raw_bytes(expected)
    if not np.array_equal(a, e):
        diff = np.flatnonzero(a != e)
        raise AssertionError(
            f"{what}: {diff.size} of {a.size} bytes differ (shape {a_shape}, dtype {dtype_name(actual)}); "
            f"first at byte {diff[0]}: got {a[diff[0]]}, expected {e[diff[0]]}"
        )
