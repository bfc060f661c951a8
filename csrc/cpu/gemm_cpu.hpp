// Blocked matrix products on CPU threads for the expert-specific operators
// (cpu/es_cpu.cpp): one product C = A B per expert, where the rows of A or B
// are read through the re-index vector instead of being copied into a
// dispatched buffer first. The gathering happens where any fast GEMM copies
// anyway: when it packs panels of A and B into its cache-sized blocks.
//
// The blocking is Goto's: B is packed once per product into KC x NR strips
// (shared by all threads), each task packs an MC x KC block of A and runs an
// MR x NR micro-kernel over it (AVX2 + FMA when the CPU has them, plain C++
// otherwise), accumulating the K blocks in order into an MC x N block of
// Acc, which the caller's epilogue turns into output rows. Every element of C
// is a sum in a fixed order (p ascending), whatever the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/thread_pool.hpp"
#include "moe/elementwise.hpp"

namespace a2a::cpu {

// Register and cache blocking per accumulator type.
template <typename Acc>
struct Tiling;
template <>
struct Tiling<float> {
  static constexpr int kMR = 6, kNR = 16;  // 12 AVX2 accumulators
  static constexpr int64_t kKC = 256, kMC = 144;
};
template <>
struct Tiling<double> {
  static constexpr int kMR = 4, kNR = 8;
  static constexpr int64_t kKC = 256, kMC = 96;
};

// c[r * ldc + j] (+)= sum over p < kc of a[p * MR + r] * b[p * NR + j] for
// r < MR, j < NR; `accumulate` adds to c, else overwrites it.
void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate);
void micro_kernel(int64_t kc, const double* a, const double* b, double* c, int64_t ldc, bool accumulate);

// Rows of a matrix operand in the caller's memory: logical row r is stored
// row gather[r] / divide (row r without gather), or zeros when gather[r] < 0;
// with gates, each row is scaled by the gate of choice gather[r].
template <typename T>
struct RowSource {
  const T* base = nullptr;
  int64_t ld = 0;                   // elements between stored rows
  const int64_t* gather = nullptr;  // choice ids (the re-index vector), or null
  int64_t divide = 1;               // top_k for an operand by token, 1 by choice
  const void* gates = nullptr;      // (T, k) per choice, or null
  bool gates_are_data = false;      // gates of type T, else float32

  // Stored row of logical row r, or null for a zero row.
  const T* row(int64_t r) const {
    if (gather == nullptr) return base + r * ld;
    const int64_t choice = gather[r];
    return choice < 0 ? nullptr : base + (choice / divide) * ld;
  }
  typename moe::Num<T>::Acc scale(int64_t r) const {
    if (gates == nullptr || gather == nullptr || gather[r] < 0) return 1;
    return moe::load_gate<T>(gates, gates_are_data, gather[r]);
  }
};

// One product C (m x n) = A (m x depth) B (depth x n). A(i, p) is
// a.row(i)[p] when a_rows_are_m, else a.row(p)[i]; B(p, j) is b.row(p)[j]
// when b_rows_are_depth, else b.row(j)[p].
template <typename T>
struct GemmJob {
  int64_t m = 0, n = 0, depth = 0;
  RowSource<T> a;
  bool a_rows_are_m = true;
  RowSource<T> b;
  bool b_rows_are_depth = true;
};

namespace gemm_detail {

template <typename T>
using AccOf = typename moe::Num<T>::Acc;

inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Packs columns [j0, j0 + NR) of B, all depth, as KC-deep strips: block q's
// strip sits at q * KC * n_padded + strip * kc_q * NR (see run_gemms).
template <typename T>
void pack_b_strip(const GemmJob<T>& job, int64_t strip, int64_t n_padded, AccOf<T>* packed) {
  using Acc = AccOf<T>;
  using Tile = Tiling<Acc>;
  constexpr int NR = Tile::kNR;
  const int64_t j0 = strip * NR;
  for (int64_t q0 = 0; q0 < job.depth; q0 += Tile::kKC) {
    const int64_t kc = std::min(Tile::kKC, job.depth - q0);
    Acc* dst = packed + q0 * n_padded + strip * kc * NR;
    if (job.b_rows_are_depth) {
      for (int64_t p = 0; p < kc; ++p) {
        const T* src = job.b.row(q0 + p);
        const Acc s = job.b.scale(q0 + p);
        for (int jj = 0; jj < NR; ++jj) {
          const int64_t j = j0 + jj;
          dst[p * NR + jj] = (src != nullptr && j < job.n) ? s * moe::Num<T>::load(src[j]) : Acc(0);
        }
      }
    } else {
      for (int jj = 0; jj < NR; ++jj) {
        const int64_t j = j0 + jj;
        const T* src = j < job.n ? job.b.row(j) : nullptr;
        const Acc s = j < job.n ? job.b.scale(j) : Acc(0);
        for (int64_t p = 0; p < kc; ++p)
          dst[p * NR + jj] = src != nullptr ? s * moe::Num<T>::load(src[q0 + p]) : Acc(0);
      }
    }
  }
}

// Packs rows [i0, i0 + mc) x depth [q0, q0 + kc) of A as MR-row micro-panels
// (panel u at u * kc * MR, element (p, r) at p * MR + r); rows past m are 0.
template <typename T>
void pack_a_block(const GemmJob<T>& job, int64_t i0, int64_t mc, int64_t q0, int64_t kc, AccOf<T>* packed) {
  using Acc = AccOf<T>;
  constexpr int MR = Tiling<Acc>::kMR;
  const int64_t panels = (mc + MR - 1) / MR;
  for (int64_t u = 0; u < panels; ++u) {
    Acc* dst = packed + u * kc * MR;
    if (job.a_rows_are_m) {
      for (int r = 0; r < MR; ++r) {
        const int64_t i = i0 + u * MR + r;
        const T* src = i < i0 + mc ? job.a.row(i) : nullptr;
        const Acc s = i < i0 + mc ? job.a.scale(i) : Acc(0);
        for (int64_t p = 0; p < kc; ++p)
          dst[p * MR + r] = src != nullptr ? s * moe::Num<T>::load(src[q0 + p]) : Acc(0);
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const T* src = job.a.row(q0 + p);
        const Acc s = job.a.scale(q0 + p);
        for (int r = 0; r < MR; ++r) {
          const int64_t i = i0 + u * MR + r;
          dst[p * MR + r] = (src != nullptr && i < i0 + mc) ? s * moe::Num<T>::load(src[i]) : Acc(0);
        }
      }
    }
  }
}

// Per-thread scratch, reused call after call (the pool's threads live on).
template <typename Acc>
Acc* scratch(std::vector<Acc>& buffer, int64_t elements) {
  // 64 spare elements let the start move to a 64-byte boundary.
  if (static_cast<int64_t>(buffer.size()) < elements + 64) buffer.resize(static_cast<size_t>(elements + 64));
  Acc* p = buffer.data();
  while (reinterpret_cast<uintptr_t>(p) % 64 != 0) ++p;
  return p;
}

}  // namespace gemm_detail

// Runs every job on `threads` threads. For each task (job, row block) the
// epilogue is called once as epilogue(job_index, i0, rows, c, ldc) with the
// finished block: C(i0 + i, j) = c[i * ldc + j] for i < rows, j < n.
// Jobs are taken in groups whose packed B fits a budget, so the packed
// weights stay a bounded copy whatever E is.
template <typename T, typename Epilogue>
void run_gemms(const std::vector<GemmJob<T>>& jobs, int threads, Epilogue&& epilogue) {
  using Acc = gemm_detail::AccOf<T>;
  using Tile = Tiling<Acc>;
  using gemm_detail::round_up;
  constexpr int MR = Tile::kMR, NR = Tile::kNR;
  constexpr int64_t kPackedBudget = int64_t{64} << 20;  // bytes of packed B per group

  thread_local std::vector<Acc> packed_b;  // kept for the next call, as a BLAS keeps its workspace
  size_t first = 0;
  while (first < jobs.size()) {
    // A group: jobs first .. last - 1 and where their packed B starts.
    std::vector<int64_t> b_offset{0};
    size_t last = first;
    while (last < jobs.size()) {
      const int64_t bytes = jobs[last].depth * round_up(jobs[last].n, NR) * static_cast<int64_t>(sizeof(Acc));
      if (last > first && (b_offset.back() * static_cast<int64_t>(sizeof(Acc)) + bytes) > kPackedBudget) break;
      b_offset.push_back(b_offset.back() + jobs[last].depth * round_up(jobs[last].n, NR));
      ++last;
    }
    Acc* const packed = gemm_detail::scratch(packed_b, b_offset.back());

    // Tasks: B strips to pack, then row blocks to compute, both as flat lists.
    std::vector<std::pair<size_t, int64_t>> strips, blocks;
    for (size_t job = first; job < last; ++job) {
      for (int64_t s = 0; s < round_up(jobs[job].n, NR) / NR; ++s) strips.emplace_back(job, s);
      for (int64_t i0 = 0; i0 < jobs[job].m; i0 += Tile::kMC) blocks.emplace_back(job, i0);
    }
    parallel_for(static_cast<int64_t>(strips.size()), 1, threads, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto [job, s] = strips[static_cast<size_t>(t)];
        gemm_detail::pack_b_strip(jobs[job], s, round_up(jobs[job].n, NR), packed + b_offset[job - first]);
      }
    });
    parallel_for(static_cast<int64_t>(blocks.size()), 1, threads, [&](int64_t begin, int64_t end) {
      thread_local std::vector<Acc> a_buffer, c_buffer;
      for (int64_t t = begin; t < end; ++t) {
        const auto [job_index, i0] = blocks[static_cast<size_t>(t)];
        const GemmJob<T>& job = jobs[job_index];
        const int64_t mc = std::min(Tile::kMC, job.m - i0);
        const int64_t ldc = round_up(job.n, NR);
        Acc* a = gemm_detail::scratch(a_buffer, round_up(mc, MR) * Tile::kKC);
        Acc* c = gemm_detail::scratch(c_buffer, round_up(mc, MR) * ldc);
        if (job.depth == 0) std::fill(c, c + round_up(mc, MR) * ldc, Acc(0));
        const Acc* b = packed + b_offset[job_index - first];
        for (int64_t q0 = 0; q0 < job.depth; q0 += Tile::kKC) {
          const int64_t kc = std::min(Tile::kKC, job.depth - q0);
          gemm_detail::pack_a_block(job, i0, mc, q0, kc, a);
          for (int64_t s = 0; s < ldc / NR; ++s)
            for (int64_t u = 0; u * MR < mc; ++u)
              micro_kernel(kc, a + u * kc * MR, b + q0 * ldc + s * kc * NR, c + u * MR * ldc + s * NR, ldc, q0 > 0);
        }
        epilogue(job_index, i0, mc, static_cast<const Acc*>(c), ldc);
      }
    });
    first = last;
  }
}

}  // namespace a2a::cpu
