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


# ---------------------------------------------------------------------------
# MoE routing, dispatch and combine (docs/moe_kernels.md), written from the
# definitions: Tutel's slot order and capacity rule, then plain indexing for
# the sparse kernels and GShard's dense einsums (Tutel, Fig. 20a) as a second
# formulation. Data and gates are passed in NumPy storage (bfloat16 as int16
# bits) with their dtype names.

MOE_DTYPES = ("float32", "float64", "float16", "bfloat16")


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (int16 or uint16 storage) -> float32 (exact)."""
    u = np.asarray(bits).view(np.uint16).astype(np.uint32) << 16
    return u.view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as int16, rounding to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x40
    bits = np.where(np.isnan(f), quiet_nan, rounded).astype(np.uint16)
    return bits.view(np.int16)


def accumulator(dtype: str) -> type:
    """Where the kernels do their arithmetic: float64 for float64, else float32."""
    return np.float64 if dtype == "float64" else np.float32


def to_float(a: np.ndarray, dtype: str, float_type: type = np.float64) -> np.ndarray:
    """Values of storage array `a` of `dtype` as `float_type` (exact when wide enough)."""
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(a).astype(float_type)
    return np.asarray(a).astype(float_type)


def from_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """Rounds float values to `dtype`, in its NumPy storage (bfloat16 from
    float64 rounds twice, through float32, as a float32 accumulator would)."""
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(np.asarray(values, dtype=np.float32))
    return np.asarray(values).astype(dtype)


def moe_data(tag: str, shape: Sequence[int], dtype: str, kind: str = "normal") -> np.ndarray:
    """Deterministic data in `dtype`'s storage. kind "normal": N(0, 1) values
    rounded to dtype; "dyadic": nonzero multiples of 1/2 in [-4, 4] (with
    dyadic gates every product and sum is exact in every dtype, so results
    compare exactly whatever the order of the arithmetic)."""
    rng = np.random.default_rng(_key(tag, *shape, len(dtype), zlib.crc32(kind.encode())))
    if kind == "normal":
        values = rng.standard_normal(tuple(shape))
    elif kind == "dyadic":
        values = rng.integers(1, 9, size=tuple(shape)) * rng.choice([-0.5, 0.5], size=tuple(shape))
    else:
        raise ValueError(kind)
    return from_float(values, dtype)


def moe_gates(tag: str, shape: Sequence[int], dtype: str, kind: str = "normal") -> np.ndarray:
    """Deterministic gates: uniform in (0, 1) ("normal") or multiples of 1/8
    in [1/8, 1] ("dyadic"), in `dtype`'s storage."""
    rng = np.random.default_rng(_key(tag + "-gates", *shape, len(dtype), zlib.crc32(kind.encode())))
    if kind == "normal":
        values = rng.uniform(0.05, 1.0, size=tuple(shape))
    elif kind == "dyadic":
        values = rng.integers(1, 9, size=tuple(shape)) / 8.0
    else:
        raise ValueError(kind)
    return from_float(values, dtype)


def moe_indices(
    tag: str, num_tokens: int, top_k: int, num_experts: int, unrouted: float = 0.0, skew: float = 0.0
) -> np.ndarray:
    """(T, k) int64 expert choices. A fraction `unrouted` of the choices is
    negative (not routed, -1 or a more negative value). `skew` > 0 makes low
    experts more popular, so that some overflow their capacity."""
    key = _key(tag, num_tokens, top_k, num_experts, int(unrouted * 1000), int(skew * 1000))
    rng = np.random.default_rng(key)
    weights = np.exp(-skew * np.arange(num_experts))
    experts = rng.choice(num_experts, size=(num_tokens, top_k), p=weights / weights.sum())
    negative = rng.random((num_tokens, top_k)) < unrouted
    return np.where(negative, -rng.integers(1, 4, size=(num_tokens, top_k)), experts).astype(np.int64)


def ref_slot_order(scores: np.ndarray) -> np.ndarray:
    """Batch Prioritized Routing's token order: descending row maximum of
    scores (T,) or (T, n), ties in token order (a stable sort)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 2:
        s = s.max(axis=1) if s.shape[1] else np.zeros(s.shape[0])
    return np.argsort(-s, kind="stable").astype(np.int64)


def ref_capacity(
    demand: np.ndarray,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    capacity: int | None = None,
    capacity_setting: float | None = None,
) -> int:
    """Tutel's rule (docs/moe_kernels.md, Capacity): a fixed capacity; x > 0:
    ceil(k*x*T/E); x == 0: the largest demand; x < 0: min(largest demand,
    ceil(k*-x*T/E)). The default setting is 1.0. The product is formed in
    float64 from left to right, as written (so x = 0.9 means 0.9: 2 * 0.9 *
    60000 / 24 is 4500.0, where the exact binary value of 0.9 would give 4501)."""
    if capacity is not None:
        return int(capacity)
    x = 1.0 if capacity_setting is None else float(capacity_setting)
    bound = math.ceil(float(top_k) * abs(x) * float(num_tokens) / float(num_experts))
    largest = int(np.max(demand)) if len(demand) else 0
    if x > 0:
        return bound
    return largest if x == 0 else min(largest, bound)


class RefRouting:
    """What a2a.route / a2a.permute return, computed in plain Python.

    indices (T, k) int64; locations (T, k) int64: -1 when not routed, else the
    number of earlier routed choices of the same expert in slot order (so
    >= capacity when dropped); demand (E,) routed choices per expert; counts
    (E,) kept ones; offsets (E + 1,); capacity (None when dropless, an (E,)
    int64 array of per-expert capacities for the ragged layout);
    num_dropped; num_rows; row_map (T, k): offsets[e] + location, or -1."""

    def __init__(self, indices, num_experts, locations, demand, capacity):
        self.indices = indices
        self.num_experts = num_experts
        self.locations = locations
        self.demand = demand
        self.capacity = capacity
        if capacity is None:
            self.counts = demand.copy()
            self.offsets = np.concatenate([[0], np.cumsum(demand)]).astype(np.int64)
        elif isinstance(capacity, np.ndarray):  # per expert: expert e owns capacity[e] rows
            self.counts = np.minimum(demand, capacity).astype(np.int64)
            self.offsets = np.concatenate([[0], np.cumsum(capacity)]).astype(np.int64)
        else:
            self.counts = np.minimum(demand, capacity).astype(np.int64)
            self.offsets = (np.arange(num_experts + 1) * capacity).astype(np.int64)
        self.num_dropped = int((demand - self.counts).sum())
        self.num_rows = int(self.offsets[-1])
        expert = np.maximum(indices, 0)
        kept = (indices >= 0) & (locations < self.counts[expert])
        self.row_map = np.where(kept, self.offsets[expert] + locations, -1).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[0]

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]


def ref_route(
    indices: np.ndarray,
    num_experts: int,
    capacity: int | None = None,
    capacity_setting: float | None = None,
    order: np.ndarray | None = None,
    dropless: bool = False,
) -> RefRouting:
    """Tutel's slot assignment: choice 0 of every token (in `order`, default
    0..T-1), then choice 1 of every token, ...; each routed choice takes the
    next slot of its expert. `dropless`: no capacity, experts packed.
    `capacity` may be (E,): one capacity per expert (the ragged layout)."""
    idx = np.asarray(indices).astype(np.int64)
    if idx.ndim != 2:
        raise ValueError(f"indices must be (T, k), got shape {idx.shape}")
    num_tokens, top_k = idx.shape
    if (idx >= num_experts).any():
        raise ValueError(f"an index is >= num_experts={num_experts}")
    tokens = list(range(num_tokens)) if order is None else [int(t) for t in order]
    if sorted(tokens) != list(range(num_tokens)):
        raise ValueError("order must be a permutation of 0..T-1")
    rows = idx.tolist()
    locations = [[-1] * top_k for _ in range(num_tokens)]
    demand = [0] * num_experts
    for j in range(top_k):
        for t in tokens:
            e = rows[t][j]
            if e >= 0:
                locations[t][j] = demand[e]
                demand[e] += 1
    locations = np.asarray(locations, dtype=np.int64).reshape(num_tokens, top_k)
    demand = np.asarray(demand, dtype=np.int64)
    if dropless:
        c = None
    elif capacity is not None and np.ndim(capacity) == 1:
        c = np.asarray(capacity, dtype=np.int64)
    else:
        c = ref_capacity(demand, num_tokens, top_k, num_experts, capacity, capacity_setting)
    return RefRouting(idx, num_experts, locations, demand, c)


def _kept(routing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, choice, row) of every kept choice."""
    row_map = np.asarray(routing.row_map)
    t, j = np.nonzero(row_map >= 0)
    return t, j, row_map[t, j]


def _gate_values(gates, gate_dtype, shape, float_type) -> np.ndarray:
    if gates is None:
        return np.ones(shape, dtype=float_type)
    return to_float(gates, gate_dtype or np.asarray(gates).dtype.name, float_type)


def ref_dispatch_rows(x, routing, gates=None, *, dtype=None, gate_dtype=None) -> np.ndarray:
    """(num_rows, M): rows[row_map[t, j]] = gate * x[t], formed in the
    kernels' arithmetic (float32, float64 for float64: both factors are exact
    there, so this is one correctly rounded product, then the store's rounding)."""
    dtype = dtype or np.asarray(x).dtype.name
    acc = accumulator(dtype)
    xv = to_float(x, dtype, acc)
    g = _gate_values(gates, gate_dtype, routing.row_map.shape, acc)
    rows = np.zeros((routing.num_rows, xv.shape[1]), dtype=acc)
    t, j, r = _kept(routing)
    rows[r] = g[t, j][:, None] * xv[t]
    return from_float(rows, dtype)


def ref_combine_rows(rows, routing, gates=None, *, dtype=None, gate_dtype=None) -> np.ndarray:
    """(T, M): y[t] = sum over kept choices j of gate * rows[row_map[t, j]],
    summed in float64, then rounded to dtype once."""
    dtype = dtype or np.asarray(rows).dtype.name
    rv = np.asarray(rows)
    rv = to_float(rv.reshape(routing.num_rows, rv.shape[-1]), dtype)
    g = _gate_values(gates, gate_dtype, routing.row_map.shape, np.float64)
    y = np.zeros((routing.num_tokens, rv.shape[1]), dtype=np.float64)
    for j in range(routing.top_k):
        t = np.flatnonzero(routing.row_map[:, j] >= 0)
        y[t] += g[t, j][:, None] * rv[routing.row_map[t, j]]
    return from_float(y, dtype)


def ref_encode(x, routing, gates=None, *, dtype=None, gate_dtype=None) -> np.ndarray:
    """Fast encode: the (E, C, M) dispatched buffer, padding rows zero; the
    ragged (num_rows, M) one with per-expert capacities."""
    assert routing.capacity is not None, "fast encode needs a capacity"
    rows = ref_dispatch_rows(x, routing, gates, dtype=dtype, gate_dtype=gate_dtype)
    if isinstance(routing.capacity, np.ndarray):
        return rows
    return rows.reshape(routing.num_experts, routing.capacity, rows.shape[-1])


def ref_decode(dispatched, routing, gates=None, *, dtype=None, gate_dtype=None) -> np.ndarray:
    """Fast decode: (T, M) from the (E, C, M) buffer."""
    return ref_combine_rows(dispatched, routing, gates, dtype=dtype, gate_dtype=gate_dtype)


def ref_permute(x, routing, *, dtype=None) -> np.ndarray:
    """Dropless permute: (N, M), expert e's tokens at rows offsets[e].. in slot order."""
    assert routing.capacity is None, "permute uses the dropless layout"
    return ref_dispatch_rows(x, routing, None, dtype=dtype)


def ref_unpermute(y_sorted, routing, gates=None, *, dtype=None, gate_dtype=None) -> np.ndarray:
    """Inverse of permute, weighting each of a token's rows by its gate and summing."""
    return ref_combine_rows(y_sorted, routing, gates, dtype=dtype, gate_dtype=gate_dtype)


def ref_dense_routing(routing, gates=None) -> tuple[np.ndarray, np.ndarray]:
    """GShard's dense tensors (T, E, C), float64: the dispatch mask (1 where
    choice (t, j) keeps slot c of expert e) and the combine weights (its gate
    there)."""
    num_tokens, num_experts, capacity = routing.num_tokens, routing.num_experts, routing.capacity
    g = np.ones(routing.row_map.shape) if gates is None else np.asarray(gates, dtype=np.float64)
    mask = np.zeros((num_tokens, num_experts, capacity))
    weights = np.zeros((num_tokens, num_experts, capacity))
    t, j, _ = _kept(routing)
    e, c = routing.indices[t, j], routing.locations[t, j]
    mask[t, e, c] = 1.0
    weights[t, e, c] = g[t, j]
    return mask, weights


def ref_gshard_dispatch(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """dispatched[e, c] = sum_t mask[t, e, c] * x[t]: O(T*E*C*M)."""
    return np.einsum("tec,tm->ecm", mask, np.asarray(x, dtype=np.float64))


def ref_gshard_combine(weights: np.ndarray, expert_out: np.ndarray) -> np.ndarray:
    """y[t] = sum_{e, c} weights[t, e, c] * expert_out[e, c]."""
    return np.einsum("tec,ecm->tm", weights, np.asarray(expert_out, dtype=np.float64))


def moe_tolerance(dtype: str, terms: int) -> float:
    """Relative bound (to the sum of the terms' magnitudes) of a sum of
    `terms` products accumulated in the kernels' type and stored as dtype,
    against the float64 reference."""
    eps = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    return (terms + 1) * eps


def as_numpy(a: Any) -> np.ndarray:
    """A NumPy copy or view of a NumPy array or a (CPU or CUDA) torch tensor;
    bfloat16 comes back as its int16 bits."""
    if isinstance(a, np.ndarray):
        return a
    t = a.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
        import torch

        t = t.view(torch.int16)
    return t.numpy()


def assert_routing_matches(got: Any, want: RefRouting, what: str = "routing") -> None:
    """Every attribute of an a2a Routing equals the reference's."""
    for name in ("indices", "locations", "counts", "offsets", "row_map"):
        a = as_numpy(getattr(got, name))
        e = getattr(want, name)
        assert a.shape == e.shape, f"{what}.{name}: shape {a.shape} != expected {e.shape}"
        if name != "indices":
            assert a.dtype == np.int64, f"{what}.{name}: dtype {a.dtype}, expected int64"
        if not np.array_equal(a, e):
            bad = np.argwhere(a != e)[:5].tolist()
            detail = f"{what}.{name} differs at {bad}:\n got {a.tolist()}\nwant {e.tolist()}"
            raise AssertionError(detail[:4000])
    if isinstance(want.capacity, np.ndarray):
        a = got.capacity
        assert got.per_expert and isinstance(a, np.ndarray) and a.dtype == np.int64, f"{what}.capacity is {a!r}"
        assert np.array_equal(a, want.capacity), f"{what}.capacity: {a.tolist()} != {want.capacity.tolist()}"
    else:
        assert not got.per_expert, f"{what}: per_expert, expected one capacity"
    for name in ("capacity", "num_dropped", "num_rows"):
        a, e = getattr(got, name), getattr(want, name)
        if name == "capacity" and isinstance(e, np.ndarray):
            continue
        assert a == e, f"{what}.{name}: {a!r} != expected {e!r}"
        assert a is None or isinstance(a, int), f"{what}.{name} is a {type(a).__name__}, expected int"
