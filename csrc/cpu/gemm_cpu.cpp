// The micro-kernels of cpu/gemm_cpu.hpp: an MR x NR block of C from packed
// panels, with AVX2 + FMA where the CPU has them (picked once, at the first
// call) and plain C++ otherwise.
#include "cpu/gemm_cpu.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define A2A_GEMM_X86 1
#endif

namespace a2a::cpu {

namespace {

template <typename Acc>
void micro_kernel_portable(int64_t kc, const Acc* a, const Acc* b, Acc* c, int64_t ldc, bool accumulate) {
  constexpr int MR = Tiling<Acc>::kMR, NR = Tiling<Acc>::kNR;
  Acc sum[MR][NR] = {};
  for (int64_t p = 0; p < kc; ++p)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) sum[r][j] += a[p * MR + r] * b[p * NR + j];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = accumulate ? c[r * ldc + j] + sum[r][j] : sum[r][j];
}

#ifdef A2A_GEMM_X86
// 6 x 16 floats: 12 accumulators, two B vectors and one broadcast of A.
__attribute__((target("avx2,fma"))) void micro_kernel_f32_avx2(int64_t kc, const float* a, const float* b, float* c,
                                                                int64_t ldc, bool accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
    a += 6;
    b += 16;
  }
  const __m256 rows[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < 6; ++r) {
    float* out = c + r * ldc;
    __m256 lo = rows[r][0], hi = rows[r][1];
    if (accumulate) {
      lo = _mm256_add_ps(_mm256_load_ps(out), lo);
      hi = _mm256_add_ps(_mm256_load_ps(out + 8), hi);
    }
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
  }
}

// 4 x 8 doubles: 8 accumulators.
__attribute__((target("avx2,fma"))) void micro_kernel_f64_avx2(int64_t kc, const double* a, const double* b,
                                                                double* c, int64_t ldc, bool accumulate) {
  __m256d acc[4][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_pd();
  for (int64_t p = 0; p < kc; ++p) {
    const __m256d b0 = _mm256_load_pd(b), b1 = _mm256_load_pd(b + 4);
    for (int r = 0; r < 4; ++r) {
      const __m256d x = _mm256_broadcast_sd(a + r);
      acc[r][0] = _mm256_fmadd_pd(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(x, b1, acc[r][1]);
    }
    a += 4;
    b += 8;
  }
  for (int r = 0; r < 4; ++r) {
    double* out = c + r * ldc;
    if (accumulate) {
      acc[r][0] = _mm256_add_pd(_mm256_load_pd(out), acc[r][0]);
      acc[r][1] = _mm256_add_pd(_mm256_load_pd(out + 4), acc[r][1]);
    }
    _mm256_store_pd(out, acc[r][0]);
    _mm256_store_pd(out + 4, acc[r][1]);
  }
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

}  // namespace

// The packed panels and C blocks are 64-byte aligned and NR is a multiple of
// the vector width, so the AVX2 kernels use aligned loads and stores.
void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate) {
#ifdef A2A_GEMM_X86
  if (has_avx2_fma()) return micro_kernel_f32_avx2(kc, a, b, c, ldc, accumulate);
#endif
  micro_kernel_portable(kc, a, b, c, ldc, accumulate);
}

void micro_kernel(int64_t kc, const double* a, const double* b, double* c, int64_t ldc, bool accumulate) {
#ifdef A2A_GEMM_X86
  if (has_avx2_fma()) return micro_kernel_f64_avx2(kc, a, b, c, ldc, accumulate);
#endif
  micro_kernel_portable(kc, a, b, c, ldc, accumulate);
}

}  // namespace a2a::cpu
