"""FP8 rows with block scales on one process: quantize_fp8 bitwise against
the NumPy reference of tests/fp8_reference.py (nearest code from a table of
every code's value) and against torch's own float8 casts, dequantize_fp8's
error bound, the packed pairs through fast_encode / permute, and the errors.

The error bound of a round trip, per element with the block's scale s
(stated in docs/moe_kernels.md): e4m3 keeps 3 mantissa bits, so
|dequantize(quantize(x)) - x| <= 2^-4 |x| + 2^-10 s + 2^-21 |x| (half a
step of a normal code, half a subnormal step, and the float32 roundings of
x * MAX / amax and of code * s); e5m2: 2^-3 |x| + 2^-17 s + 2^-21 |x|.
"""

from __future__ import annotations

import fp8_reference as fref
import numpy as np
import pytest
import reference as ref
from checks import raises_invalid

import a2a
from a2a import _C, _fp8

torch = pytest.importorskip("torch")

TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BOUNDS = {"e4m3": (2.0**-4, 2.0**-10), "e5m2": (2.0**-3, 2.0**-17)}


def data(shape, kind, seed=0):
    """float32 rows: N(0, 1) with magnitudes spread over 2^-40 .. 2^40 per
    row ("wide"), or "special": zero rows, NaN, infinities, subnormals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind in ("wide", "special"):
        x *= np.float32(2.0) ** rng.integers(-40, 40, (shape[0], 1)).astype(np.float32)
    if kind == "special" and shape[0] >= 4 and shape[1] >= 3:
        x[0] = 0
        x[1, 0], x[1, 2] = np.nan, -np.inf
        x[2] *= np.float32(1e-42)  # float32 subnormals
        x[3, ::2] = -0.0
    return x


def as_input(x, dtype):
    """x in `dtype`: NumPy for float32/float64/float16, torch for bfloat16."""
    if dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16)
    with np.errstate(over="ignore"):  # "wide" rows overflow float16 to infinity, which is a case too
        return x.astype(dtype)


def as_float32(a):
    return a.float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float32)


def code_bytes(q):
    return q.view(torch.uint8).numpy() if isinstance(q, torch.Tensor) else np.asarray(q)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("model_dim,block", [(1, 128), (7, 128), (128, 128), (200, 64), (1000, 128), (33, 1),
                                             (130, 100)])
@pytest.mark.parametrize("kind", ["normal", "wide", "special"])
def test_quantize_matches_reference(fmt, dtype, model_dim, block, kind):
    x = as_input(data((9, model_dim), kind), dtype)
    q, scales = a2a.quantize_fp8(x, block, format=fmt)
    codes, expected_scales = fref.quantize(as_float32(x), block, fmt)
    assert q.shape == (9, model_dim) and scales.shape == (9, -(-model_dim // block))
    np.testing.assert_array_equal(code_bytes(q), codes)
    ref.assert_bitwise_equal(as_float32(scales), expected_scales, "scales")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codes_decode_as_torch_does(fmt):
    """All 256 codes with a scale of 1: torch's own float8 -> float32."""
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    y = a2a.dequantize_fp8(codes, np.ones((2, 1), np.float32), format=fmt)
    expected = torch.from_numpy(codes.copy()).view(TORCH_DTYPES[fmt]).float().numpy()
    np.testing.assert_array_equal(y, expected)  # NaN codes included: assert_array_equal matches NaN with NaN


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codes_are_torchs_casts(fmt):
    """Within range, each code is torch's cast of x * MAX / amax (its rounding
    to nearest even, done independently of ours)."""
    x = torch.from_numpy(data((64, 256), "wide", seed=3))
    q, scales = a2a.quantize_fp8(x, 128, format=fmt)
    max_value = 448.0 if fmt == "e4m3" else 57344.0
    amax = x.abs().reshape(64, 2, 128).amax(dim=2)
    multiplier = torch.float32_tensor = (torch.tensor(max_value) / amax).repeat_interleave(128, dim=1)
    expected = (x * multiplier).to(TORCH_DTYPES[fmt])
    assert q.dtype == TORCH_DTYPES[fmt]
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scales, amax / max_value)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_ties_round_to_even(fmt):
    """One block whose amax is MAX (a multiplier of exactly 1): the midpoint
    between each two consecutive positive codes goes to the even one."""
    table = fref.code_values(fmt)
    max_value = fref.FORMATS[fmt][3]
    mids = [(table[c] + table[c + 1]) / 2 for c in range(0x7F) if np.isfinite(table[c + 1])]
    row = np.array([max_value, *mids, *(-m for m in mids)], np.float32)
    q, scales = a2a.quantize_fp8(row[None, :], block=row.size, format=fmt)
    assert scales[0, 0] == np.float32(1)
    lower = np.arange(len(mids))
    for codes in (q[0, 1:len(mids) + 1].astype(int), q[0, len(mids) + 1:].astype(int) - 0x80):
        assert np.all(codes % 2 == 0) and np.all((codes == lower) | (codes == lower + 1))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_within_the_stated_bound(fmt, dtype):
    x = as_input(data((33, 700), "wide", seed=5), dtype)
    q, scales = a2a.quantize_fp8(x, 128, format=fmt)
    y = as_float32(a2a.dequantize_fp8(q, scales, block=128, dtype="float32", format=fmt))  # NumPy codes: say it
    xf = as_float32(x).astype(np.float64)
    relative, step = BOUNDS[fmt]
    s = np.repeat(as_float32(scales), 128, axis=1)[:, :700].astype(np.float64)
    bound = relative * np.abs(xf) + step * s + 2.0**-21 * np.abs(xf)
    assert np.all(np.abs(y - xf) <= bound)
    if dtype == "bfloat16":  # torch: a bfloat16 result is one more rounding of the float32 one
        yb = a2a.dequantize_fp8(q, scales, block=128, dtype="bfloat16")
        ref.assert_bitwise_equal(yb, torch.from_numpy(y).to(torch.bfloat16), "bfloat16 output")
    else:
        try:
            np.dtype("bfloat16")  # registered by ml_dtypes, which JAX (among others) imports
        except TypeError:
            raises_invalid(lambda: a2a.dequantize_fp8(q, scales, dtype="bfloat16"), "NumPy has no bfloat16")
        else:
            yb = a2a.dequantize_fp8(q, scales, block=128, dtype="bfloat16", format=fmt)
            want = torch.from_numpy(y).to(torch.bfloat16).view(torch.int16).numpy()
            np.testing.assert_array_equal(yb.view(np.int16), want)


def test_zero_blocks_have_zero_scales_and_no_nan():
    x = np.zeros((3, 300), np.float32)
    x[1, 200:] = 2.0
    q, scales = a2a.quantize_fp8(x, 128)
    assert scales[0].tolist() == [0, 0, 0] and scales[1, :1].tolist() == [0]
    y = a2a.dequantize_fp8(q, scales)
    assert not np.isnan(y).any() and np.array_equal(y, x)


@pytest.mark.parametrize("model_dim,block", [(m, b) for m in (0, 1, 15, 16, 17, 128, 1000, 7168) for b in (1, 3, 128)])
def test_packed_layout_is_the_cores(model_dim, block):
    assert _fp8.packed_layout(model_dim, -(-model_dim // block)) == _C.fp8_packed_layout(model_dim, block)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_pair_is_two_views_of_packed_rows(framework):
    x = data((2, 3, 200), "normal")
    x = torch.from_numpy(x) if framework == "torch" else x
    q, scales = a2a.quantize_fp8(x, 64)
    packed = a2a.pack_fp8(q, scales)
    assert tuple(packed.shape) == (2, 3, 224)
    address = packed.data_ptr() if framework == "torch" else packed.ctypes.data
    assert address == (q.data_ptr() if framework == "torch" else q.ctypes.data)  # no copy
    # Separate arrays pack into the same bytes; unpack gives the pair back.
    copies = (q.contiguous(), scales.contiguous()) if framework == "torch" else (q.copy(), scales.copy())
    assert np.array_equal(ref.raw_bytes(a2a.pack_fp8(*copies)), ref.raw_bytes(packed))
    q2, s2 = a2a.unpack_fp8(packed, 200, block=64)
    assert np.array_equal(code_bytes(q2), code_bytes(q)) and np.array_equal(as_float32(s2), as_float32(scales))
    y1 = a2a.dequantize_fp8(q, scales, block=64)
    y2 = a2a.dequantize_fp8(*copies, block=64)
    assert np.array_equal(as_float32(y1), as_float32(y2))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("capacity", [3, "dropless"])
def test_fast_encode_and_permute_move_each_row_with_its_scales(framework, capacity):
    rng = np.random.default_rng(7)
    x = data((40, 260), "wide", seed=8)
    indices = rng.integers(-1, 5, (40, 2))
    if framework == "torch":
        x, indices = torch.from_numpy(x), torch.from_numpy(indices)
    q, scales = a2a.quantize_fp8(x, 128)
    codes, row_scales = code_bytes(q).copy(), as_float32(scales).copy()
    if capacity == "dropless":
        (q_rows, s_rows), _perm = a2a.permute((q, scales), indices, 5)
        expected_codes = a2a.permute(codes, np.asarray(indices), 5)[0]
        expected_scales = a2a.permute(row_scales, np.asarray(indices), 5)[0]
    else:
        routing = a2a.route(indices, 5, capacity=capacity)
        q_rows, s_rows = a2a.fast_encode((q, scales), routing)
        np_routing = a2a.route(np.asarray(indices), 5, capacity=capacity)
        expected_codes = a2a.fast_encode(codes.view(np.float32), np_routing).view(np.uint8)
        expected_scales = a2a.fast_encode(row_scales, np_routing)
        assert tuple(q_rows.shape) == (5, 3, 260)
    if framework == "torch":
        assert q_rows.dtype == torch.float8_e4m3fn
    assert np.array_equal(code_bytes(q_rows).reshape(expected_codes.shape), expected_codes)
    ref.assert_bitwise_equal(as_float32(s_rows).reshape(expected_scales.shape), expected_scales, "scales")


def test_errors_name_the_argument():
    x = data((4, 256), "normal")
    raises_invalid(lambda: a2a.quantize_fp8(x, 0), "quantize_fp8", "block must be an int in [1, 2**62]")
    raises_invalid(lambda: a2a.quantize_fp8(x, 2**63), "quantize_fp8", "block must be an int in [1, 2**62]")
    raises_invalid(lambda: a2a.quantize_fp8(x, True), "quantize_fp8", "block must be an int")
    assert np.array_equal(a2a.pack_fp8(*a2a.quantize_fp8(x, np.int64(64))), a2a.pack_fp8(*a2a.quantize_fp8(x, 64)))
    raises_invalid(lambda: a2a.quantize_fp8(x, format="e3m4"), "quantize_fp8", "format must be one of e4m3, e5m2")
    raises_invalid(lambda: a2a.quantize_fp8(x.astype(np.int32)), "quantize_fp8", "x must be (..., M) of float32")
    raises_invalid(lambda: a2a.quantize_fp8(x[:, ::2]), "quantize_fp8", "not C-contiguous")
    q, scales = a2a.quantize_fp8(x, 128)
    raises_invalid(lambda: a2a.dequantize_fp8(q, scales, block=64), "dequantize_fp8",
                   "scales have 2 blocks per row; M = 256 with block = 64 has 4")
    raises_invalid(lambda: a2a.dequantize_fp8(q, scales[:2]), "dequantize_fp8", "must share their leading axes")
    raises_invalid(lambda: a2a.dequantize_fp8(q, scales.astype(np.float64)), "dequantize_fp8", "must be float32")
    raises_invalid(lambda: a2a.dequantize_fp8(q, scales, dtype="int8"), "dequantize_fp8", "dtype must be one of")
    tq, ts = a2a.quantize_fp8(torch.from_numpy(x))
    raises_invalid(lambda: a2a.dequantize_fp8(tq, ts, format="e5m2"), "format 'e5m2' disagrees with q's dtype")
    routing = a2a.route(np.zeros((4, 1), np.int64), 2, capacity=4)
    raises_invalid(lambda: a2a.fast_encode((q, scales), routing, np.ones((4, 1), np.float32)),
                   "fast_encode", "takes no gates")
    raises_invalid(lambda: a2a.fast_encode(np.zeros((4, 6), np.uint8), routing), "multiple of 4 bytes")


def test_core_refuses_overlapping_memory():
    x = np.zeros((2, 64), np.float32)
    scales = np.zeros((2, 1), np.float32)
    rows = (2, 64, 64, 0, x.ctypes.data, 64, scales.ctypes.data, 1)  # codes over x
    raises_invalid(lambda: _C.quantize_fp8((0, 0, 0), x.ctypes.data, 0, rows), "quantize_fp8", "overlaps q")
    codes = np.zeros((2, 64), np.uint8)
    rows = (2, 64, 64, 0, codes.ctypes.data, 64, codes.ctypes.data + 60, 16)  # scales over the codes
    raises_invalid(lambda: _C.quantize_fp8((0, 0, 0), x.ctypes.data, 0, rows), "the codes", "overlap")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_quantize_into_out(framework):
    x = data((5, 300), "normal")
    x = torch.from_numpy(x) if framework == "torch" else x
    out = a2a.quantize_fp8(x * 0, 128)
    again = a2a.quantize_fp8(x, 128, out=out)
    assert again is out
    fresh = a2a.quantize_fp8(x, 128)
    assert np.array_equal(ref.raw_bytes(a2a.pack_fp8(*out)), ref.raw_bytes(fresh.packed))
    raises_invalid(lambda: a2a.quantize_fp8(x, 64, out=out), "quantize_fp8", "out must be a pair over packed rows")
    apart = (np.zeros((5, 300), np.uint8), np.zeros((5, 3), np.float32))
    raises_invalid(lambda: a2a.quantize_fp8(data((5, 300), "normal"), 128, out=apart), "written in place")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_pair_is_checked_against_its_buffer_and_copies_view_their_own(framework):
    import copy
    import pickle

    x = data((4, 256), "normal")
    x = torch.from_numpy(x) if framework == "torch" else x
    pair = a2a.quantize_fp8(x, 128, format="e5m2")
    assert isinstance(a2a.Fp8Pair(pair[0], pair[1], pair.packed), a2a.Fp8Pair)
    # A buffer that the views do not view would be trusted by every call that takes the pair.
    other = a2a.quantize_fp8(x, 128, format="e5m2").packed
    for wrong in (other, other[:2], pair.packed[:2]):
        raises_invalid(lambda wrong=wrong: a2a.Fp8Pair(pair[0], pair[1], wrong), "Fp8Pair(q, scales, packed)",
                       "is not the buffer that q and scales view")
    raises_invalid(lambda: a2a.Fp8Pair(pair[0], pair[1], other[:, :16]), "Fp8Pair(q, scales, packed): packed")
    raises_invalid(lambda: a2a.Fp8Pair(pair[0], pair[1][:2], pair.packed), "must share their leading axes")
    # A copy's views view the copied buffer: writing into it (out=) changes what the copy holds.
    fresh = a2a.quantize_fp8(2 * x, 128, format="e5m2")
    for copied in (pickle.loads(pickle.dumps(pair)), copy.deepcopy(pair), copy.copy(pair)):
        assert type(copied) is a2a.Fp8Pair and copied[0].dtype == pair[0].dtype
        assert np.array_equal(ref.raw_bytes(copied.packed), ref.raw_bytes(pair.packed))
        again = a2a.quantize_fp8(2 * x, 128, format="e5m2", out=copied)
        assert again is copied
        assert np.array_equal(as_float32(a2a.dequantize_fp8(*again)), as_float32(a2a.dequantize_fp8(*fresh)))


def test_quantize_refuses_read_only_out():
    x = data((4, 256), "normal")
    frozen = bytes(4 * 272)
    pair = a2a.unpack_fp8(np.frombuffer(frozen, np.uint8).reshape(4, 272), 256)
    raises_invalid(lambda: a2a.quantize_fp8(x, out=pair), "quantize_fp8", "read-only packed rows")
    assert frozen == bytes(4 * 272)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_unpack_refuses_rows_whose_scales_would_be_misaligned(framework):
    buffer = np.zeros(4 * 272 + 1, np.uint8)
    buffer = torch.from_numpy(buffer) if framework == "torch" else buffer
    raises_invalid(lambda: a2a.unpack_fp8(buffer[1:].reshape(4, 272), 256), "unpack_fp8",
                   "must start at a 4-byte aligned address")
