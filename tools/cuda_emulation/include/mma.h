// WMMA emulation: every thread of a warp holds the whole 16x16 fragment and
// does the warp's operation itself; a store writes only the lane's share of
// the tile (element i by lane i % 32), as on the GPU, so that ThreadSanitizer
// sees no two lanes write one element. Checks the pointer (32-byte) and ldm
// rules.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include "core/half.hpp"
#include "cuda_runtime.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace nvcuda::wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float v[16][16];
};

inline float to_float(__half h) { return a2a::half_to_float(h.x); }
inline float to_float(__nv_bfloat16 h) { return a2a::bfloat16_to_float(h.x); }

inline void check(const void* p, unsigned ldm, size_t element) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * element) % 16 != 0) {
    std::fprintf(stderr, "emu wmma: pointer %p (mod 32 = %u) or ldm %u breaks the alignment rules\n", p,
                 unsigned(reinterpret_cast<uintptr_t>(p) % 32), ldm);
    std::abort();
  }
}

template <class Use, int M, int N, int K, class T, class Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  check(p, ldm, sizeof(T));
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r][c] = to_float(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
}
template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
  check(p, ldm, sizeof(float));
  const unsigned lane = emu::runtime.linear_thread() % emu::kWarp;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      if (static_cast<unsigned>(r * 16 + c) % emu::kWarp == lane)
        (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.v[r][c];
}
template <int M, int N, int K>
void fill_fragment(fragment<accumulator, M, N, K, float>& f, float value) {
  for (auto& row : f.v)
    for (float& x : row) x = value;
}
template <int M, int N, int K, class T, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  float out[16][16];
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 16; ++col) {
      float s = c.v[r][col];
      for (int k = 0; k < 16; ++k) s += a.v[r][k] * b.v[k][col];
      out[r][col] = s;
    }
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 16; ++col) d.v[r][col] = out[r][col];
}
}  // namespace nvcuda
