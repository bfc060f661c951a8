// CPU backend of the fused top-k gate: threads over tokens (cpu/thread_pool)
// for the rows, then the loss's columns in gating.hpp's lane order (the
// CUDA backend's, so both give the same bits).
#include "cpu/gating_cpu.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "cpu/thread_pool.hpp"
#include "moe/gating.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

using cpu::grain_for;
using cpu::parallel_for;

template <typename T>
void forward(const a2a_top_k_gate_t& g, const T* logits, T* scores, int64_t* indices, T* gates, T* share, T* l_aux,
             void* workspace, int threads) {
  const int64_t E = g.num_experts, k = g.top_k;
  parallel_for(g.num_tokens, grain_for(E * 4), threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      top_k_gate_row(logits + t * E, E, k, g.normalize != 0, scores + t * E, indices + t * k, gates + t * k);
  });
  // The columns in gating.hpp's lane order, read row by row (a column's
  // stride would read the scores once per expert): lane l's running sums of
  // every expert, over the tokens l, l + kGateLanes, ..., then the lanes in
  // order. The same additions in the same order as gate_column_lane's.
  auto* sums = static_cast<double*>(workspace);
  auto* firsts = reinterpret_cast<int64_t*>(sums + E);
  const int64_t lanes = std::min<int64_t>(kGateLanes, g.num_tokens);
  std::vector<double> lane_sums(static_cast<size_t>(lanes * E), 0.0);
  std::vector<int64_t> lane_firsts(static_cast<size_t>(lanes * E), 0);
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    double* lane_sum = lane_sums.data() + (t % kGateLanes) * E;
    const T* row = scores + t * E;
    for (int64_t e = 0; e < E; ++e) lane_sum[e] += static_cast<double>(Num<T>::load(row[e]));
    ++lane_firsts[static_cast<size_t>((t % kGateLanes) * E + indices[t * k])];
  }
  for (int64_t e = 0; e < E; ++e) {
    double total = 0;
    int64_t count = 0;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      total += lane_sums[static_cast<size_t>(lane * E + e)];
      count += lane_firsts[static_cast<size_t>(lane * E + e)];
    }
    sums[e] = total;
    firsts[e] = count;
    share[e] = gate_share<T>(count, g.num_tokens);
  }
  *l_aux = from_double<T>(gshard_loss_of_columns(sums, firsts, g.num_tokens, E));
}

template <typename T>
void backward(const a2a_top_k_gate_t& g, const T* scores, const int64_t* indices, const T* share, const T* d_gates,
              const T* d_l_aux, T* d_logits, int threads) {
  const int64_t E = g.num_experts, k = g.top_k;
  const auto loss_scale = gate_loss_scale(d_l_aux, E, g.num_tokens);
  std::atomic<int64_t> bad_row{-1};
  parallel_for(g.num_tokens, grain_for(E * 4), threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bool ok = top_k_gate_backward_row(scores + t * E, indices + t * k, d_gates == nullptr ? nullptr : d_gates + t * k,
                                              share, loss_scale, E, k, g.normalize != 0, d_logits + t * E);
      if (!ok) {  // keep the first bad token, whichever thread meets it
        int64_t first = bad_row.load();
        while ((first < 0 || t < first) && !bad_row.compare_exchange_weak(first, t)) {
        }
      }
    }
  });
  const int64_t t = bad_row.load();
  if (t >= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "top_k_gate_backward: the indices of token ", t, " are not ", k,
         " distinct experts in 0..", E - 1, "; pass the indices the forward gave");
}

}  // namespace

void top_k_gate_cpu(const a2a_top_k_gate_t& gate, const void* logits, void* scores, int64_t* indices, void* gates,
                    void* share, void* l_aux, void* workspace, int threads) {
  with_float_type("top_k_gate", gate.dtype, [&](auto tag) {
    using T = decltype(tag);
    forward(gate, static_cast<const T*>(logits), static_cast<T*>(scores), indices, static_cast<T*>(gates),
            static_cast<T*>(share), static_cast<T*>(l_aux), workspace, threads);
  });
}

void top_k_gate_backward_cpu(const a2a_top_k_gate_t& gate, const void* scores, const int64_t* indices,
                             const void* share, const void* d_gates, const void* d_l_aux, void* d_logits,
                             int threads) {
  with_float_type("top_k_gate_backward", gate.dtype, [&](auto tag) {
    using T = decltype(tag);
    backward(gate, static_cast<const T*>(scores), indices, static_cast<const T*>(share),
             static_cast<const T*>(d_gates), static_cast<const T*>(d_l_aux), static_cast<T*>(d_logits), threads);
  });
}

}  // namespace a2a::moe
