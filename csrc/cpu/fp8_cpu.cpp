// CPU backend of the FP8 row quantization: threads over rows
// (cpu/thread_pool), one block of a row at a time (its amax, then its codes),
// with the element logic of moe/fp8.hpp. On x86-64 with AVX2 (picked at run
// time), float and bfloat16 rows run the same per-element operations 8 lanes
// at a time: the same bits.
#include "cpu/fp8_cpu.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/bf16_avx2.hpp"
#include "cpu/thread_pool.hpp"
#include "moe/elementwise.hpp"
#include "moe/fp8.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

using cpu::grain_for;
using cpu::parallel_for;

// One row: its blocks' amax, scale and codes.
template <typename T, typename Format>
inline void quantize_row(const T* __restrict x, int64_t cols, int64_t block, float max_value, uint8_t* __restrict q,
                         float* __restrict scales) {
  for (int64_t begin = 0, b = 0; begin < cols; begin += block, ++b) {
    const int64_t n = std::min(block, cols - begin);
    const T* __restrict src = x + begin;
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = fold_amax(amax, static_cast<float>(Num<T>::load(src[i])));
    const BlockScale s = block_scale(amax, max_value);
    scales[b] = s.scale;
    uint8_t* __restrict dst = q + begin;
    for (int64_t i = 0; i < n; ++i) dst[i] = Format::encode(static_cast<float>(Num<T>::load(src[i])) * s.multiplier);
  }
}

template <typename T, typename Format>
inline void dequantize_row(const uint8_t* __restrict q, const float* __restrict scales, int64_t cols, int64_t block,
                           T* __restrict y) {
  for (int64_t begin = 0, b = 0; begin < cols; begin += block, ++b) {
    const int64_t n = std::min(block, cols - begin);
    const float scale = scales[b];
    for (int64_t i = 0; i < n; ++i)
      y[begin + i] = Num<T>::store(static_cast<typename Num<T>::Acc>(Format::decode(q[begin + i]) * scale));
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define A2A_FP8_AVX2 1
// Blocks up to this many channels are widened once, into an L1 buffer.
constexpr int64_t kStagedBlock = 512;
// The same per-element operations as Format::encode / decode and the row
// loops above, 8 lanes at a time by hand (GCC does not vectorize the amax
// reduction, nor the narrowing to bytes, by itself): the same bits.

__attribute__((target("avx2"))) inline __m256i splat(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

// 8 elements of x as floats.
__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const bfloat16_t* p) { return load_bf16x8(p); }

// Format::encode of 8 floats, in the low byte of each 32-bit lane.
template <typename Format>
__attribute__((target("avx2"))) inline __m256i encode8(__m256 f) {
  constexpr int kDropped = Format::kDropped;
  const __m256i u = _mm256_castps_si256(f);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), splat(0x80u));
  const __m256i magnitude = _mm256_and_si256(u, splat(0x7fffffffu));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, kDropped), splat(1u));
  __m256i normal = _mm256_add_epi32(_mm256_sub_epi32(magnitude, splat(Format::kRebias)),
                                    splat((1u << (kDropped - 1)) - 1u));
  normal = _mm256_min_epu32(_mm256_srli_epi32(_mm256_add_epi32(normal, odd), kDropped), splat(Format::kMaxCode));
  const __m256 base = _mm256_castsi256_ps(splat(Format::kTinyBaseBits));
  const __m256i tiny = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(magnitude), base)),
                                        splat(Format::kTinyBaseBits));
  const __m256i is_tiny = _mm256_cmpgt_epi32(splat(Format::kMinNormalBits), magnitude);
  const __m256i bits = _mm256_or_si256(sign, _mm256_blendv_epi8(normal, tiny, is_tiny));
  return _mm256_blendv_epi8(bits, splat(0x7fu), _mm256_cmpgt_epi32(magnitude, splat(0x7f800000u)));
}

// Four vectors of codes (one per 32-bit lane) as 32 bytes, in order.
__attribute__((target("avx2"))) inline void store_codes32(uint8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  // 4-byte groups now a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7.
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
}

template <typename T, typename Format>
__attribute__((target("avx2"))) void quantize_row_avx2(const T* __restrict x, int64_t cols, int64_t block,
                                                      float max_value, uint8_t* __restrict q,
                                                      float* __restrict scales) {
  const __m256 abs_mask = _mm256_castsi256_ps(splat(0x7fffffffu));
  // A block's elements as floats, kept between its two passes (L1) when it fits.
  alignas(32) float staged[kStagedBlock];
  const bool staging = block <= kStagedBlock;
  for (int64_t begin = 0, b = 0; begin < cols; begin += block, ++b) {
    const int64_t n = std::min(block, cols - begin);
    const T* __restrict src = x + begin;
    __m256 lanes = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {  // max_ps returns its second operand for a NaN first: NaN ignored
      const __m256 v = load8(src + i);
      if (staging) _mm256_store_ps(staged + i, v);
      lanes = _mm256_max_ps(_mm256_and_ps(v, abs_mask), lanes);
    }
    alignas(32) float partial[8];
    _mm256_store_ps(partial, lanes);
    float amax = 0.0f;
    for (float p : partial) amax = fold_amax(amax, p);
    for (; i < n; ++i) amax = fold_amax(amax, static_cast<float>(Num<T>::load(src[i])));
    const BlockScale s = block_scale(amax, max_value);
    scales[b] = s.scale;
    const __m256 multiplier = _mm256_set1_ps(s.multiplier);
    uint8_t* __restrict dst = q + begin;
    i = 0;
    auto scaled = [&](int64_t j) __attribute__((target("avx2"), always_inline)) {
      return _mm256_mul_ps(staging ? _mm256_load_ps(staged + j) : load8(src + j), multiplier);
    };
    for (; i + 32 <= n; i += 32)
      store_codes32(dst + i, encode8<Format>(scaled(i)), encode8<Format>(scaled(i + 8)),
                    encode8<Format>(scaled(i + 16)), encode8<Format>(scaled(i + 24)));
    for (; i < n; ++i) dst[i] = Format::encode(static_cast<float>(Num<T>::load(src[i])) * s.multiplier);
  }
}

// Format::decode of the 8 codes in the low 8 bytes of c.
template <typename Format>
__attribute__((target("avx2"))) inline __m256 decode8(__m128i c8) {
  constexpr int kMantissaBits = 23 - Format::kDropped;
  const __m256i c = _mm256_cvtepu8_epi32(c8);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, splat(0x80u)), 24);
  const __m256i low = _mm256_and_si256(c, splat(0x7fu));
  const __m256i exponent = _mm256_srli_epi32(low, kMantissaBits);
  const __m256i mantissa = _mm256_and_si256(c, splat((1u << kMantissaBits) - 1u));
  const __m256i normal = _mm256_or_si256(sign, _mm256_add_epi32(_mm256_slli_epi32(low, Format::kDropped),
                                                                splat(Format::kRebias)));
  const __m256 step = _mm256_castsi256_ps(splat(Format::kTinyBaseBits - (23u << 23)));
  const __m256i tiny = _mm256_or_si256(sign, _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mantissa), step)));
  __m256i bits = _mm256_blendv_epi8(normal, tiny, _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
  const __m256i top = _mm256_cmpeq_epi32(exponent, splat(0x7fu >> kMantissaBits));
  const __m256i zero_mantissa = _mm256_cmpeq_epi32(mantissa, _mm256_setzero_si256());
  __m256i nan;
  if constexpr (Format::kFiniteOnly) {
    nan = _mm256_cmpeq_epi32(low, splat(0x7fu));
  } else {
    nan = _mm256_andnot_si256(zero_mantissa, top);
    bits = _mm256_blendv_epi8(bits, _mm256_or_si256(sign, splat(0x7f800000u)), _mm256_and_si256(top, zero_mantissa));
  }
  return _mm256_castsi256_ps(_mm256_blendv_epi8(bits, splat(0x7fc00000u), nan));
}

__attribute__((target("avx2"))) inline void store16(float* p, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
}
__attribute__((target("avx2"))) inline void store16(bfloat16_t* p, __m256 lo, __m256 hi) {
  store_bf16x16<false>(p, lo, hi);
}

template <typename T, typename Format>
__attribute__((target("avx2"))) void dequantize_row_avx2(const uint8_t* __restrict q, const float* __restrict scales,
                                                        int64_t cols, int64_t block, T* __restrict y) {
  for (int64_t begin = 0, b = 0; begin < cols; begin += block, ++b) {
    const int64_t n = std::min(block, cols - begin);
    const float scale = scales[b];
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + begin + i));
      store16(y + begin + i, _mm256_mul_ps(decode8<Format>(codes), s),
              _mm256_mul_ps(decode8<Format>(_mm_srli_si128(codes, 8)), s));
    }
    for (; i < n; ++i) y[begin + i] = Num<T>::store(static_cast<typename Num<T>::Acc>(Format::decode(q[begin + i]) * scale));
  }
}

bool has_avx2() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}

// The AVX2 rows of T (float and bfloat16: the dispatch's dtypes), else none.
template <typename T>
constexpr bool kVectorRows = std::is_same_v<T, float> || std::is_same_v<T, bfloat16_t>;
#endif

template <typename T, typename Format>
void quantize_typed(const T* x, const a2a_fp8_rows_t& r, int threads) {
  auto row_kernel = quantize_row<T, Format>;
#ifdef A2A_FP8_AVX2
  if constexpr (kVectorRows<T>)
    if (has_avx2()) row_kernel = quantize_row_avx2<T, Format>;
#endif
  const float max_value = fp8_max(r.format);
  parallel_for(r.rows, grain_for(r.cols), threads, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      row_kernel(x + row * r.cols, r.cols, r.block, max_value, static_cast<uint8_t*>(r.q) + row * r.q_stride,
                 r.scales + row * r.scale_stride);
  });
}

template <typename T, typename Format>
void dequantize_typed(const a2a_fp8_rows_t& r, T* y, int threads) {
  auto row_kernel = dequantize_row<T, Format>;
#ifdef A2A_FP8_AVX2
  if constexpr (kVectorRows<T>)
    if (has_avx2()) row_kernel = dequantize_row_avx2<T, Format>;
#endif
  parallel_for(r.rows, grain_for(r.cols), threads, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      row_kernel(static_cast<const uint8_t*>(r.q) + row * r.q_stride, r.scales + row * r.scale_stride, r.cols,
                 r.block, y + row * r.cols);
  });
}

}  // namespace

void quantize_fp8_cpu(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows, int threads) {
  with_fp8_types("quantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    quantize_typed<T, decltype(format)>(static_cast<const T*>(x), rows, threads);
  });
}

void dequantize_fp8_cpu(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y, int threads) {
  with_fp8_types("dequantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    dequantize_typed<T, decltype(format)>(rows, static_cast<T*>(y), threads);
  });
}

}  // namespace a2a::moe
