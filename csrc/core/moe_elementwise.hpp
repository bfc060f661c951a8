// Per-element logic of the MoE kernels, shared by the CPU backend (plain C++)
// and the CUDA backend (nvcc, as __host__ __device__ functions), so a CPU test
// exercises the arithmetic the GPU runs: the float16 / bfloat16 conversions
// (round to nearest even, done on the bits so that both sides agree exactly),
// the accumulator type of each dtype, index loads, and which row of the
// dispatched buffer a (token, choice) occupies.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"

#if defined(__CUDACC__)
#define A2A_HD __host__ __device__ __forceinline__
#else
#define A2A_HD inline
#endif

namespace a2a::moe {

// Storage types of the 16-bit floats: raw bits, converted through float.
struct half_t {
  uint16_t bits;
};
struct bfloat16_t {
  uint16_t bits;
};

A2A_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}

A2A_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

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

// Numeric traits per storage type: the accumulator (float for 16- and 32-bit
// floats, double for double) and the conversions to and from it.
template <typename T>
struct Num;

template <>
struct Num<float> {
  using Acc = float;
  A2A_HD static Acc load(float v) { return v; }
  A2A_HD static float store(Acc a) { return a; }
};
template <>
struct Num<double> {
  using Acc = double;
  A2A_HD static Acc load(double v) { return v; }
  A2A_HD static double store(Acc a) { return a; }
};
template <>
struct Num<half_t> {
  using Acc = float;
  A2A_HD static Acc load(half_t v) { return half_to_float(v.bits); }
  A2A_HD static half_t store(Acc a) { return half_t{float_to_half(a)}; }
};
template <>
struct Num<bfloat16_t> {
  using Acc = float;
  A2A_HD static Acc load(bfloat16_t v) { return bfloat16_to_float(v.bits); }
  A2A_HD static bfloat16_t store(Acc a) { return bfloat16_t{float_to_bfloat16(a)}; }
};

// Element i of an int32 or int64 index array.
A2A_HD int64_t load_index(const void* indices, a2a_dtype_t index_dtype, int64_t i) {
  return index_dtype == A2A_INT32 ? static_cast<int64_t>(static_cast<const int32_t*>(indices)[i])
                                  : static_cast<const int64_t*>(indices)[i];
}

// The choice (flat index t * k + j) at position p of Tutel's slot order: all
// first choices, then all second choices, ...; within one choice, tokens in
// token_order (or in order).
A2A_HD int64_t choice_at(int64_t position, int64_t num_tokens, int64_t top_k, const int64_t* token_order) {
  const int64_t j = position / num_tokens;
  const int64_t r = position - j * num_tokens;
  const int64_t t = token_order ? token_order[r] : r;
  return t * top_k + j;
}

// Row of the dispatched buffer that choice i = t * k + j occupies, or -1 when
// it is not routed or was dropped (its location is past its expert's count).
A2A_HD int64_t kept_row(const a2a_routing_t& routing, int64_t choice) {
  const int64_t expert = load_index(routing.indices, routing.index_dtype, choice);
  if (expert < 0) return -1;
  const int64_t location = routing.locations[choice];
  if (location < 0 || location >= routing.counts[expert]) return -1;
  return routing.expert_offsets[expert] + location;
}

// Gate of choice i as the accumulator type (1 when there are no gates).
// gate_is_data: the gates have the data's storage type T, else float32.
template <typename T>
A2A_HD typename Num<T>::Acc load_gate(const void* gates, bool gate_is_data, int64_t choice) {
  using Acc = typename Num<T>::Acc;
  if (gates == nullptr) return Acc(1);
  if (gate_is_data) return Num<T>::load(static_cast<const T*>(gates)[choice]);
  return static_cast<Acc>(static_cast<const float*>(gates)[choice]);
}

// Stores an accumulated gate gradient as the gates' dtype.
template <typename T>
A2A_HD void store_gate(void* grad_gates, bool gate_is_data, int64_t choice, typename Num<T>::Acc value) {
  if (gate_is_data)
    static_cast<T*>(grad_gates)[choice] = Num<T>::store(value);
  else
    static_cast<float*>(grad_gates)[choice] = static_cast<float>(value);
}

}  // namespace a2a::moe
