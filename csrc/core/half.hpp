// float16 and bfloat16: storage types and conversions to and from float,
// written once for the host (plain C++) and the GPU (nvcc compiles them as
// __host__ __device__ functions). They work on the bits, rounding to nearest
// even, so that the CPU and the GPU agree exactly: the MoE kernels
// (moe/elementwise.hpp) and the MPI float16/bfloat16 reductions use them.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define A2A_HD __host__ __device__ __forceinline__
#else
#define A2A_HD inline
#endif

namespace a2a {

// Storage types of the 16-bit floats: raw bits, converted through float.
struct half_t {
  uint16_t bits;
};
struct bfloat16_t {
  uint16_t bits;
};

// The bits of a float and back: an intrinsic in device code, a bit cast on the host.
#if defined(__CUDA_ARCH__)
A2A_HD uint32_t float_bits(float f) { return __float_as_uint(f); }
A2A_HD float bits_float(uint32_t u) { return __uint_as_float(u); }
#else
A2A_HD uint32_t float_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
A2A_HD float bits_float(uint32_t u) { return __builtin_bit_cast(float, u); }
#endif

// The conversions below are branch-free (every case computed, then
// selected) so that the CPU compiler vectorizes the loops around them.

A2A_HD float bfloat16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
A2A_HD uint16_t float_to_bfloat16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

A2A_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  const uint32_t special = sign | 0x7f800000u | (mantissa << 13);               // infinity, NaN
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const uint32_t tiny = sign | float_bits(static_cast<float>(static_cast<int32_t>(mantissa)) * 5.9604644775390625e-8f);
  return bits_float(exponent == 0x1fu ? special : exponent == 0 ? tiny : normal);
}

// Round to nearest even, with IEEE overflow to infinity and gradual underflow.
A2A_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7fffffffu;
  // >= 2^16 (after rounding, everything >= 65520 ends up here or carries
  // into the exponent below): infinity, or a quiet NaN.
  const uint32_t special = magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // Normal half: rebias the exponent (127 -> 15) and round the 13 dropped
  // bits to nearest even; a carry out of the mantissa moves the exponent up.
  const uint32_t normal = (magnitude - 0x38000000u + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
  // Below 2^-14 (subnormal half or zero): adding 0.5f puts the value's bits
  // in units of 2^-24 at the bottom of the mantissa, rounded to nearest even
  // by the float addition itself.
  const uint32_t tiny = float_bits(bits_float(magnitude) + 0.5f) - 0x3f000000u;
  const uint32_t bits = magnitude >= 0x47800000u ? special : magnitude < 0x38800000u ? tiny : normal;
  return static_cast<uint16_t>(sign | bits);
}

}  // namespace a2a
