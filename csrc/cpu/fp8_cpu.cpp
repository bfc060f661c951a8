// CPU backend of the FP8 row quantization: threads over rows
// (cpu/thread_pool), one block of a row at a time (its amax, then its codes),
// with the element logic of moe/fp8.hpp. On x86-64 the row loops are compiled
// twice, for the baseline ISA and for AVX2 (picked at run time); both run the
// same operations per element, so they give the same bits.
#include "cpu/fp8_cpu.hpp"

#include <algorithm>
#include <cstdint>

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
template <typename T, typename Format>
__attribute__((target("avx2"), flatten)) void quantize_row_avx2(const T* __restrict x, int64_t cols, int64_t block,
                                                               float max_value, uint8_t* __restrict q,
                                                               float* __restrict scales) {
  quantize_row<T, Format>(x, cols, block, max_value, q, scales);
}
template <typename T, typename Format>
__attribute__((target("avx2"), flatten)) void dequantize_row_avx2(const uint8_t* __restrict q,
                                                                 const float* __restrict scales, int64_t cols,
                                                                 int64_t block, T* __restrict y) {
  dequantize_row<T, Format>(q, scales, cols, block, y);
}
bool has_avx2() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}
#define A2A_FP8_AVX2 1
#endif

template <typename T, typename Format>
void quantize_typed(const T* x, const a2a_fp8_rows_t& r, int threads) {
  auto row_kernel = quantize_row<T, Format>;
#ifdef A2A_FP8_AVX2
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
  if (has_avx2()) row_kernel = dequantize_row_avx2<T, Format>;
#endif
  parallel_for(r.rows, grain_for(r.cols), threads, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      row_kernel(static_cast<const uint8_t*>(r.q) + row * r.q_stride, r.scales + row * r.scale_stride, r.cols,
                 r.block, y + row * r.cols);
  });
}

// Calls fn with the storage type and the format's struct.
template <typename Fn>
void with_types(const char* op, a2a_dtype_t dtype, a2a_fp8_format_t format, Fn&& fn) {
  with_float_type(op, dtype, [&](auto tag) {
    if (format == A2A_FP8_E5M2)
      fn(tag, E5m2{});
    else
      fn(tag, E4m3{});
  });
}

}  // namespace

void quantize_fp8_cpu(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows, int threads) {
  with_types("quantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    quantize_typed<T, decltype(format)>(static_cast<const T*>(x), rows, threads);
  });
}

void dequantize_fp8_cpu(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y, int threads) {
  with_types("dequantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    dequantize_typed<T, decltype(format)>(rows, static_cast<T*>(y), threads);
  });
}

}  // namespace a2a::moe
