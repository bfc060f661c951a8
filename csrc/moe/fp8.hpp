// Per-element logic of the FP8 row quantization (a2a_quantize_fp8 /
// a2a_dequantize_fp8), shared by the CPU backend (cpu/fp8_cpu.cpp) and the
// CUDA one (cuda/fp8_cuda.cu) so that both give the same bits: the float8
// encodings (e4m3fn and e5m2, round to nearest even, saturating at the
// largest finite value, NaN to 0x7f), their decoding, and a block's scale.
//
// A block of up to `block` channels of one row with amax = max |x| (NaN
// ignored) is stored as
//     scale = amax / MAX            (float32; MAX = 448 for e4m3, 57344 for e5m2)
//     q[i]  = encode(x[i] * (MAX / amax))   (0 when amax == 0)
// and read back as decode(q[i]) * scale, rounded once to the output dtype.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"
#include "core/half.hpp"

namespace a2a::moe {

// One float8 format: kMantissa bits of mantissa, exponent bias kBias.
// Encoding is branch-free (every case computed, then selected) so that the
// CPU compiler vectorizes the loops around it, as core/half.hpp does.
template <int kMantissaBits, int kExponentBias, uint32_t kMaxCodeValue, bool kFiniteOnlyValue>
struct Fp8Format {
  static constexpr uint32_t kMaxCode = kMaxCodeValue;  // largest finite magnitude's code
  static constexpr bool kFiniteOnly = kFiniteOnlyValue;  // no infinity; only S.1111.111 is NaN (e4m3fn)
  // Float bits of 2^(1 - bias), the smallest normal magnitude.
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kExponentBias) << 23;
  // Exponent rebias 127 -> bias, as float bits.
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kExponentBias) << 23;
  static constexpr int kDropped = 23 - kMantissaBits;  // mantissa bits a float has beyond ours
  // 2^(1 - bias - mantissa + 23): a float whose unit in the last place is the
  // subnormal step 2^(1 - bias - mantissa), as bits.
  static constexpr uint32_t kTinyBaseBits = static_cast<uint32_t>(127 + 1 - kExponentBias - kMantissaBits + 23) << 23;

  static A2A_HD uint8_t encode(float f) {
    const uint32_t u = float_bits(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t magnitude = u & 0x7fffffffu;
    // Normal: rebias and round the dropped bits to nearest even (a carry out
    // of the mantissa moves the exponent up); beyond the largest finite
    // value, including infinity: saturate.
    uint32_t normal = (magnitude - kRebias + ((1u << (kDropped - 1)) - 1u) + ((magnitude >> kDropped) & 1u)) >> kDropped;
    normal = normal > kMaxCode ? kMaxCode : normal;
    // Subnormal or zero: adding 2^(tiny base) puts the value in units of the
    // subnormal step at the bottom of the mantissa, rounded to nearest even
    // by the float addition itself (a result of 1 << mantissa is the
    // smallest normal, whose code it also is).
    const float base = bits_float(kTinyBaseBits);
    const uint32_t tiny = float_bits(bits_float(magnitude) + base) - kTinyBaseBits;
    // NaN: 0x7f whatever its sign, which a GPU's arithmetic does not keep.
    const uint32_t bits = magnitude < kMinNormalBits ? tiny : normal;
    return static_cast<uint8_t>(magnitude > 0x7f800000u ? 0x7fu : sign | bits);
  }

  static A2A_HD float decode(uint8_t code) {
    const uint32_t c = code;
    const uint32_t sign = (c & 0x80u) << 24;
    const uint32_t exponent = (c & 0x7fu) >> kMantissaBits;
    const uint32_t mantissa = c & ((1u << kMantissaBits) - 1u);
    const uint32_t normal = sign | (((c & 0x7fu) << kDropped) + kRebias);
    // Zero or subnormal: mantissa steps of 2^(1 - bias - mantissa), exact in float.
    const float step = bits_float(kTinyBaseBits - (23u << 23));
    const uint32_t tiny = sign | float_bits(static_cast<float>(static_cast<int32_t>(mantissa)) * step);
    constexpr uint32_t kTopExponent = (0x7fu >> kMantissaBits);
    // e4m3fn has no infinity: only S.1111.111 is NaN. e5m2 is IEEE-like:
    // the top exponent is infinity (mantissa 0) or NaN.
    const bool nan = kFiniteOnly ? (c & 0x7fu) == 0x7fu : exponent == kTopExponent && mantissa != 0;
    const bool infinite = !kFiniteOnly && exponent == kTopExponent && mantissa == 0;
    const uint32_t bits = nan ? 0x7fc00000u : infinite ? (sign | 0x7f800000u) : exponent == 0 ? tiny : normal;
    return bits_float(bits);
  }
};

// e4m3fn (torch.float8_e4m3fn, OCP's E4M3): largest finite 448 (code 0x7e).
using E4m3 = Fp8Format<3, 7, 0x7eu, true>;
// e5m2 (torch.float8_e5m2): largest finite 57344 (code 0x7b).
using E5m2 = Fp8Format<2, 15, 0x7bu, false>;

// The largest finite value of a format, the amax a block is scaled to.
A2A_HD float fp8_max(a2a_fp8_format_t format) { return format == A2A_FP8_E5M2 ? 57344.0f : 448.0f; }

// |x| folded into a running maximum, NaN ignored (a NaN compares false).
A2A_HD float fold_amax(float amax, float x) {
  const float a = bits_float(float_bits(x) & 0x7fffffffu);
  return a > amax ? a : amax;
}

// A block's stored scale and the multiplier its elements are encoded with:
// amax / MAX and MAX / amax, both 0 for an all-zero block. amax is taken as
// at least MAX * 2^-127, so that MAX / amax stays finite (2^127 at most):
// a block that small, whose codes then use less than the format's range,
// would otherwise multiply its zeros by infinity.
struct BlockScale {
  float scale;
  float multiplier;
};
A2A_HD BlockScale block_scale(float amax, float max_value) {
  const float floor = max_value * 5.877471754111438e-39f;  // MAX * 2^-127, exact
  const float a = amax > floor ? amax : floor;
  return amax > 0.0f ? BlockScale{a / max_value, max_value / a} : BlockScale{0.0f, 0.0f};
}

// Packed rows (a2a_fp8_packed_layout): the codes, padded to 16 bytes, then
// the scales, padded to 16 bytes.
A2A_HD int64_t fp8_blocks(int64_t cols, int64_t block) { return (cols + block - 1) / block; }
A2A_HD int64_t round_up_16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

}  // namespace a2a::moe
