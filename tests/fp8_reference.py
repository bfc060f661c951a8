"""Plain-NumPy reference of the FP8 row quantization (a2a.quantize_fp8),
written from the formats' definitions rather than from the kernels' bit
tricks: every code's value is listed, and a value is encoded as the nearest
one (ties to the even code), saturating at the largest finite value. A
block's amax is floored at MAX * 2^-127 (a2a.h says why)."""

from __future__ import annotations

import numpy as np

# (exponent bits, mantissa bits, bias, largest finite value, has infinity)
FORMATS = {"e4m3": (4, 3, 7, 448.0, False), "e5m2": (5, 2, 15, 57344.0, True)}


def code_values(fmt: str) -> np.ndarray:
    """float64 value of each of the 256 codes (NaN for NaN codes, +-inf)."""
    exp_bits, man_bits, bias, _, has_inf = FORMATS[fmt]
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code & 0x7F) >> man_bits
        m = code & ((1 << man_bits) - 1)
        top = (1 << exp_bits) - 1
        if has_inf and e == top:
            values[code] = sign * np.inf if m == 0 else np.nan
        elif not has_inf and (code & 0x7F) == 0x7F:
            values[code] = np.nan
        elif e == 0:
            values[code] = sign * m * 2.0 ** (1 - bias - man_bits)
        else:
            values[code] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return values


def encode(values: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values -> codes (uint8): nearest finite code, ties to the even
    code, beyond the largest finite value the largest; NaN -> 0x7f."""
    table = code_values(fmt)
    positive = np.arange(0x80)
    finite = positive[np.isfinite(table[:0x80])]
    magnitudes = table[finite]  # increasing
    v = np.asarray(values, dtype=np.float32).astype(np.float64)
    a = np.minimum(np.abs(v), FORMATS[fmt][3])
    upper = np.clip(np.searchsorted(magnitudes, a, side="left"), 0, len(magnitudes) - 1)
    lower = np.maximum(upper - 1, 0)
    down, up = a - magnitudes[lower], magnitudes[upper] - a
    pick_up = (up < down) | ((up == down) & (finite[upper] % 2 == 0))
    codes = np.where(pick_up, finite[upper], finite[lower]).astype(np.uint8)
    codes = np.where(a == magnitudes[upper], finite[upper], codes).astype(np.uint8)
    sign = (np.signbit(v).astype(np.uint8) << 7).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0x7F), sign | codes).astype(np.uint8)


def quantize(x: np.ndarray, block: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """x (rows, M) as float32 -> (codes (rows, M) uint8, scales (rows, blocks) float32)."""
    x = np.asarray(x, dtype=np.float32)
    rows, model_dim = x.shape
    blocks = -(-model_dim // block)
    max_value = np.float32(FORMATS[fmt][3])
    codes = np.zeros((rows, model_dim), np.uint8)
    scales = np.zeros((rows, blocks), np.float32)
    for b in range(blocks):
        part = x[:, b * block:(b + 1) * block]
        amax = np.nanmax(np.abs(part), axis=1, initial=0.0).astype(np.float32) if part.size else np.zeros(rows)
        amax = np.asarray(amax, dtype=np.float32)
        floored = np.maximum(amax, max_value * np.float32(2.0**-127))  # MAX / amax stays finite
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            scale = np.where(amax > 0, floored / max_value, np.float32(0)).astype(np.float32)
            multiplier = np.where(amax > 0, max_value / floored, np.float32(0)).astype(np.float32)
            codes[:, b * block:(b + 1) * block] = encode(part * multiplier[:, None], fmt)
        scales[:, b] = scale
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray, block: int, fmt: str) -> np.ndarray:
    """float32 fp8_to_float(code) * scale."""
    table = code_values(fmt).astype(np.float32)
    per_channel = np.repeat(scales, block, axis=1)[:, : codes.shape[1]]
    with np.errstate(invalid="ignore", over="ignore"):
        return (table[codes] * per_channel).astype(np.float32)
