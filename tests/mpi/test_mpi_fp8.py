"""FP8 pairs (q, scales) through the exchanges under mpirun: all_to_all,
all_to_all_flex and all_to_all_v of a pair against the whole-world NumPy
reference of its codes and scales (tests/fp8_reference.py quantizes every
rank's input, tests/reference.py exchanges it), bitwise; one exchange per
call; a bad pair on one rank fails on every rank."""

from __future__ import annotations

import zlib

import fp8_reference as fref
import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, run_or_expect_rejection

import a2a
from a2a import _collectives

ALGOS = ["linear", "2dh"]
MODEL_DIMS = {"m200-b64": (200, 64), "m7-b128": (7, 128), "m256-b128": (256, 128)}


def rank_data(tag: str, rank: int, shape) -> np.ndarray:
    """float32 data of one rank, magnitudes spread per row, some zero rows."""
    rng = np.random.default_rng([zlib.crc32(tag.encode()), rank, *shape])
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-20, 20, (*shape[:-1], 1)).astype(np.float32)
    x.reshape(-1, shape[-1])[:: 5] = 0
    return x


def reference_pairs(tag: str, world: int, shape, block: int, fmt: str = "e4m3"):
    """Every rank's (codes, scales), from the NumPy quantizer."""
    pairs = []
    for r in range(world):
        x = rank_data(tag, r, shape)
        codes, scales = fref.quantize(x.reshape(-1, shape[-1]), block, fmt)
        pairs.append((codes.reshape(*shape[:-1], -1), scales.reshape(*shape[:-1], -1)))
    return pairs


def check_pair(result, codes, scales, what):
    q, s = result
    ref.assert_bitwise_equal(np.asarray(q), codes, f"{what}: codes")
    ref.assert_bitwise_equal(np.asarray(s), scales, f"{what}: scales")


@pytest.mark.parametrize("dims", list(MODEL_DIMS))
@pytest.mark.parametrize("algo", ALGOS)
def test_flex_pair_matches_reference(comm, algo, dims):
    """The MoE dispatch's exchange: split the expert axis, concatenate along
    the capacity."""
    model_dim, block = MODEL_DIMS[dims]
    shape = (comm.size * 2, 3, model_dim)
    tag = f"flex-{dims}"
    pairs = reference_pairs(tag, comm.size, shape, block)
    codes = ref.ref_all_to_all_flex([p[0] for p in pairs], 0, 1)[comm.rank]
    scales = ref.ref_all_to_all_flex([p[1] for p in pairs], 0, 1)[comm.rank]
    pair = a2a.quantize_fp8(rank_data(tag, comm.rank, shape), block)
    result = run_or_expect_rejection(
        comm, algo, lambda: a2a.all_to_all_flex(pair, comm=comm, split_axis=0, concat_axis=1, algo=algo))
    if result is not None:
        check_pair(result, codes, scales, f"flex {algo} rank {comm.rank}")


@pytest.mark.parametrize("pattern", ["varied", "empty_odd_ranks", "odd_large"])
@pytest.mark.parametrize("algo", ALGOS)
def test_v_pair_matches_reference(comm, algo, pattern):
    counts = ref.v_counts(pattern, comm.size)
    model_dim, block = 300, 128
    tag = f"v-{pattern}"
    pairs = reference_pairs(tag, comm.size, (int(counts.sum(axis=1).max()) + 1, model_dim), block)
    inputs = [(c[: counts[r].sum()], s[: counts[r].sum()]) for r, (c, s) in enumerate(pairs)]
    expected = ref.ref_all_to_all_v([c for c, _ in inputs], counts)[comm.rank]
    expected_scales = ref.ref_all_to_all_v([s for _, s in inputs], counts)[comm.rank]
    x = rank_data(tag, comm.rank, (int(counts.sum(axis=1).max()) + 1, model_dim))[: counts[comm.rank].sum()]
    pair = a2a.quantize_fp8(np.ascontiguousarray(x), block)
    result = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all_v(pair, counts[comm.rank], comm=comm, algo=algo))
    if result is None:
        return
    received, received_counts = result
    assert received_counts.tolist() == expected[1].tolist()
    check_pair(received, expected[0], expected_scales[0], f"v {pattern} {algo} rank {comm.rank}")


@pytest.mark.parametrize("algo", ALGOS)
def test_all_to_all_pair_in_torch(comm, algo):
    torch = pytest.importorskip("torch")
    shape = (comm.size * 3, 130)
    pairs = reference_pairs("a2a", comm.size, shape, 128, "e5m2")
    codes = ref.ref_all_to_all([p[0] for p in pairs])[comm.rank]
    scales = ref.ref_all_to_all([p[1] for p in pairs])[comm.rank]
    q, s = a2a.quantize_fp8(torch.from_numpy(rank_data("a2a", comm.rank, shape)), 128, format="e5m2")
    result = run_or_expect_rejection(comm, algo, lambda: a2a.all_to_all((q, s), comm=comm, algo=algo))
    if result is None:
        return
    assert result[0].dtype == torch.float8_e5m2 and result[1].dtype == torch.float32
    check_pair((result[0].view(torch.uint8).numpy(), result[1].numpy()), codes, scales, f"torch {algo}")
    # The received pair is itself packed rows: it exchanges again without a copy.
    assert a2a.pack_fp8(*result).data_ptr() == result[0].data_ptr()


def test_pair_is_one_exchange(comm, monkeypatch):
    calls = []
    real = _collectives.all_to_all_flex
    monkeypatch.setattr(_collectives, "all_to_all_flex", lambda *a, **k: calls.append(1) or real(*a, **k))
    pair = a2a.quantize_fp8(rank_data("once", comm.rank, (comm.size, 2, 256)), 128)
    a2a.all_to_all_flex(pair, comm=comm, split_axis=0, concat_axis=1)
    assert len(calls) == 1


@pytest.mark.parametrize("bad", ["not-a-pair", "mismatched-rows", "last-axis"])
def test_bad_pair_fails_on_every_rank(comm, bad):
    q, s = a2a.quantize_fp8(rank_data("bad", comm.rank, (comm.size * 2, 64)), 32)
    culprit = comm.size - 1
    fragments = {"not-a-pair": "a tuple of 3", "mismatched-rows": "must share their leading axes",
                 "last-axis": "not its last axis"}[bad]
    split = 1 if (bad == "last-axis" and comm.rank == culprit) else 0
    if comm.rank == culprit and bad == "not-a-pair":
        x = (q, s, s)
    elif comm.rank == culprit and bad == "mismatched-rows":
        x = (q, s[1:])
    else:
        x = (q, s)
    error = None
    try:
        a2a.all_to_all_flex(x, comm=comm, split_axis=split, concat_axis=0)
    except a2a.A2AError as caught:
        error = caught
    check_bad_rank(comm, culprit, "all_to_all_flex", error, fragments)


def test_separate_arrays_and_out(comm):
    """A pair of separate arrays is packed first (same result); out= takes a
    pair of packed views and is written in place; one of separate arrays is
    refused on every rank."""
    shape = (comm.size * 2, 3, 200)
    pair = a2a.quantize_fp8(rank_data("out", comm.rank, shape), 64)
    assert isinstance(pair, a2a.Fp8Pair)
    flex = {"comm": comm, "split_axis": 0, "concat_axis": 1}
    expected = a2a.all_to_all_flex(pair, **flex)
    separate = (np.ascontiguousarray(pair[0]), np.ascontiguousarray(pair[1]))
    check_pair(a2a.all_to_all_flex(separate, **flex), np.asarray(expected[0]), np.asarray(expected[1]), "separate")
    out = a2a.quantize_fp8(np.zeros((2, comm.size * 3, 200), np.float32), 64)
    assert a2a.all_to_all_flex(pair, out=out, **flex) is out
    check_pair(out, np.asarray(expected[0]), np.asarray(expected[1]), "out")
    culprit = comm.size - 1
    bad_out = (np.zeros_like(out[0]), np.zeros_like(out[1])) if comm.rank == culprit else out
    error = None
    try:
        a2a.all_to_all_flex(pair, out=bad_out, **flex)
    except a2a.A2AError as caught:
        error = caught
    check_bad_rank(comm, culprit, "all_to_all_flex", error, "written in place")
