// bfloat16 <-> float for 8 or 16 lanes with AVX2, shared by the CPU kernels
// (cpu/moe_cpu.cpp, cpu/fp8_cpu.cpp). Each function carries its own
// target("avx2") attribute: callers pick these at run time, after checking
// that the CPU has AVX2.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "core/half.hpp"

namespace a2a {

// bfloat16 by hand with AVX2: GCC's vectorization of float_to_bfloat16 spends
// about twice the instructions (it tests NaN with integer compares and masks
// before packing), and bfloat16 rows are compute-bound on a small machine.
// Same rounding, same bits (checked against float_to_bfloat16 over all 2^32
// floats); a scalar tail uses the shared functions.

// 16 bfloat16 at p widened to two vectors of 8 floats (elements 0-7, 8-15).
__attribute__((target("avx2"))) inline void load_bf16x16(const bfloat16_t* p, __m256* lo, __m256* hi) {
  const __m256i in = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(in)), 16));
  *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(in, 1)), 16));
}

// float_to_bfloat16 of 8 floats, in the low 16 bits of each 32-bit lane.
__attribute__((target("avx2"))) inline __m256i round_bf16x8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

// Stores float_to_bfloat16 of 16 floats (lo: elements 0-7, hi: 8-15); with
// kStream, p is 32-byte aligned and the store is non-temporal.
template <bool kStream>
__attribute__((target("avx2"))) inline void store_bf16x16(bfloat16_t* p, __m256 lo, __m256 hi) {
  const __m256i packed = _mm256_packus_epi32(round_bf16x8(lo), round_bf16x8(hi));  // lanes: 0-3 8-11 4-7 12-15
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xd8);
  if constexpr (kStream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ordered);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ordered);
}

// 8 bfloat16 at p widened to 8 floats.
__attribute__((target("avx2"))) inline __m256 load_bf16x8(const bfloat16_t* p) {
  const __m128i in = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(in), 16));
}

}  // namespace a2a

#endif
