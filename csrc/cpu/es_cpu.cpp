// CPU backend of the expert-specific operators. ESMM and ESTMM are one
// blocked product per expert (cpu/gemm_cpu.hpp) whose packers read the
// tokens through the re-index vector; ESS is a per-expert column sum.
#include "cpu/es_cpu.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/gemm_cpu.hpp"
#include "cpu/thread_pool.hpp"
#include "moe/elementwise.hpp"

namespace a2a::moe {

namespace {

using cpu::GemmJob;
using cpu::parallel_for;
using cpu::RowSource;

// Columns per ESS task (its accumulators stay in L1).
constexpr int64_t kSumColumns = 256;

int64_t divisor(a2a_es_rows_t rows, int64_t top_k) { return rows == A2A_ES_ROWS_TOKEN ? top_k : 1; }

// routed[c] = 1 for every choice the re-index vector holds.
std::vector<unsigned char> routed_choices(const a2a_es_index_t& index) {
  std::vector<unsigned char> routed(static_cast<size_t>(index.num_tokens * index.top_k), 0);
  for (int64_t s = 0; s < index.num_slots; ++s)
    if (index.slots[s] >= 0) routed[static_cast<size_t>(index.slots[s])] = 1;
  return routed;
}

template <typename T>
void esmm_typed(const a2a_es_index_t& index, const EsMatmul& p, int threads) {
  using Acc = typename Num<T>::Acc;
  const int64_t k = index.top_k, n = p.n, depth = p.x.dim;
  const bool by_token = p.y_rows == A2A_ES_ROWS_TOKEN;
  const bool summed = by_token && k > 1;  // each token's k results go through the workspace
  const T* x = static_cast<const T*>(p.x.data);
  const T* w = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  Acc* sums = static_cast<Acc*>(p.workspace);

  std::vector<GemmJob<T>> jobs;
  std::vector<int64_t> expert_of_job;
  for (int64_t e = 0; e < index.num_experts; ++e) {
    if (index.counts[e] == 0) continue;
    GemmJob<T> job;
    job.m = index.counts[e];
    job.n = n;
    job.depth = depth;
    job.a.base = x;
    job.a.ld = depth;
    job.a.gather = index.slots + index.expert_starts[e];
    job.a.divide = divisor(p.x.rows, k);
    job.a_rows_are_m = true;
    // B(p, j) = w[e][j][p] (NK: rows of w are output columns) or w[e][p][j] (KN).
    job.b.base = w + e * n * depth;
    job.b.ld = p.w_layout == A2A_ES_WEIGHT_NK ? depth : n;
    job.b_rows_are_depth = p.w_layout == A2A_ES_WEIGHT_KN;
    jobs.push_back(job);
    expert_of_job.push_back(e);
  }
  cpu::run_gemms(jobs, threads, [&](size_t j, int64_t i0, int64_t rows, const Acc* c, int64_t ldc) {
    const int64_t e = expert_of_job[j];
    const int64_t* slots = index.slots + index.expert_starts[e] + i0;
    const T* b = bias == nullptr ? nullptr : bias + e * n;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t choice = slots[i];
      const Acc g = load_gate<T>(p.gates.data, p.gates.is_data, choice);
      const Acc* product = c + i * ldc;
      if (summed) {
        Acc* dst = sums + choice * n;
        for (int64_t col = 0; col < n; ++col)
          dst[col] = g * (product[col] + (b ? Num<T>::load(b[col]) : Acc(0)));
      } else {
        T* dst = y + (by_token ? choice / k : choice) * n;
        for (int64_t col = 0; col < n; ++col)
          dst[col] = Num<T>::store(g * (product[col] + (b ? Num<T>::load(b[col]) : Acc(0))));
      }
    }
  });

  // Rows no expert wrote: zeros; with k > 1 by token, each token's sum in choice order.
  const std::vector<unsigned char> routed = routed_choices(index);
  const int64_t out_rows = by_token ? index.num_tokens : index.num_tokens * k;
  parallel_for(out_rows, cpu::grain_for(n), threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* dst = y + r * n;
      if (!summed) {
        if (!routed[static_cast<size_t>(r)]) std::fill(dst, dst + n, Num<T>::store(Acc(0)));
        continue;
      }
      for (int64_t col = 0; col < n; ++col) {
        Acc total = 0;
        for (int64_t j = 0; j < k; ++j)
          if (routed[static_cast<size_t>(r * k + j)]) total += sums[(r * k + j) * n + col];
        dst[col] = Num<T>::store(total);
      }
    }
  });
}

template <typename T>
void ess_typed(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, T* out, int threads) {
  using Acc = typename Num<T>::Acc;
  const int64_t n = x.dim, k = index.top_k;
  const int64_t blocks = (n + kSumColumns - 1) / kSumColumns;
  const T* data = static_cast<const T*>(x.data);
  parallel_for(index.num_experts * blocks, 1, threads, [&](int64_t begin, int64_t end) {
    Acc acc[kSumColumns];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / blocks, j0 = (task % blocks) * kSumColumns;
      const int64_t width = std::min(kSumColumns, n - j0);
      std::fill(acc, acc + width, Acc(0));
      const int64_t first = index.expert_starts[e];
      for (int64_t s = first; s < first + index.counts[e]; ++s) {
        const int64_t choice = index.slots[s];
        const Acc g = load_gate<T>(gates.data, gates.is_data, choice);
        const T* src = data + es_row(x.rows, choice, k) * n + j0;
        for (int64_t col = 0; col < width; ++col) acc[col] += g * Num<T>::load(src[col]);
      }
      for (int64_t col = 0; col < width; ++col) out[e * n + j0 + col] = Num<T>::store(acc[col]);
    }
  });
}

template <typename T>
void estmm_typed(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates, T* out,
                 int threads) {
  using Acc = typename Num<T>::Acc;
  const int64_t k = index.top_k;
  std::vector<GemmJob<T>> jobs(static_cast<size_t>(index.num_experts));
  for (int64_t e = 0; e < index.num_experts; ++e) {
    GemmJob<T>& job = jobs[static_cast<size_t>(e)];
    job.m = a.dim;
    job.n = b.dim;
    job.depth = index.counts[e];  // 0: the product is zeros
    const int64_t* slots = index.slots + index.expert_starts[e];
    // A(i, p) = gate_p * a[row(slot p)][i]: the gates are folded into A's panels.
    job.a = RowSource<T>{static_cast<const T*>(a.data), a.dim, slots, divisor(a.rows, k), gates.data, gates.is_data};
    job.a_rows_are_m = false;
    job.b = RowSource<T>{static_cast<const T*>(b.data), b.dim, slots, divisor(b.rows, k), nullptr, false};
    job.b_rows_are_depth = true;
  }
  cpu::run_gemms(jobs, threads, [&](size_t e, int64_t i0, int64_t rows, const Acc* c, int64_t ldc) {
    for (int64_t i = 0; i < rows; ++i) {
      T* dst = out + (static_cast<int64_t>(e) * a.dim + i0 + i) * b.dim;
      for (int64_t col = 0; col < b.dim; ++col) dst[col] = Num<T>::store(c[i * ldc + col]);
    }
  });
}

}  // namespace

void es_scatter_slots_cpu(const RouteProblem& problem, const int64_t* locations, const int64_t* expert_starts,
                          int64_t num_slots, int64_t* slots) {
  std::fill(slots, slots + num_slots, int64_t{-1});
  const int64_t choices = problem.num_tokens * problem.top_k;
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t e = load_index(problem.indices, problem.index_dtype, c);
    if (e >= 0) slots[expert_starts[e] + locations[c]] = c;
  }
}

void esmm_cpu(const a2a_es_index_t& index, const EsMatmul& problem, int threads) {
  with_float_type("esmm", problem.dtype, [&](auto tag) { esmm_typed<decltype(tag)>(index, problem, threads); });
}

void ess_cpu(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, a2a_dtype_t dtype, void* out,
             int threads) {
  with_float_type("ess", dtype, [&](auto tag) {
    using T = decltype(tag);
    ess_typed<T>(index, x, gates, static_cast<T*>(out), threads);
  });
}

void estmm_cpu(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates,
               a2a_dtype_t dtype, void* out, int threads) {
  with_float_type("estmm", dtype, [&](auto tag) {
    using T = decltype(tag);
    estmm_typed<T>(index, a, b, gates, static_cast<T*>(out), threads);
  });
}

}  // namespace a2a::moe
