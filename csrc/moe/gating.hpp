// Per-row logic of the fused top-k gate (a2a_top_k_gate and its backward),
// shared by the CPU backend (cpu/gating_cpu.cpp) and the CUDA one
// (cuda/gating_cuda.cu), so that both take the same steps in the same order.
// A row is one token's E logits of T (float32, float64, float16 or bfloat16),
// computed in Num<T>::Acc (float; double for float64). A 16-bit dtype is
// rounded where torch's ops on it round: the scores (their softmax in float),
// the chosen scores' sum, and each gate. The choices are of the logits (the
// softmax keeps their order), so that a 16-bit score's rounding ties none.
//
//   forward:  scores  = softmax(logits)                     (E)
//             indices = the k largest scores (of the logits), best first;
//                       equal ones by the lower expert; NaN rows 0..k-1  (k)
//             gates   = scores[indices], divided by max(their sum, eps) when
//                       normalized                           (k)
//   columns:  share[e] = (tokens whose first choice is e) / tokens
//             l_aux    = E * sum_e mean_t(scores[t, e]) * share[e]  (GShard's loss)
//   backward: dr      = normalized ? (dgates - [sum >= eps] * <dgates, gates>) / max(sum, eps) : dgates
//             dscores = dr at the chosen experts + dl_aux * E / tokens * share
//             dlogits = scores * (dscores - <dscores, scores>)        (softmax's backward)
//
// Products that a sum follows are formed by `product` (never fused into an
// FMA, which nvcc would do and the CPU build does not), so an emulated CUDA
// kernel gives the CPU's bits.
#pragma once

#include <cstdint>
#include <type_traits>

#if !defined(__CUDACC__)
#include <cmath>
#endif

#include "core/half.hpp"
#include "moe/elementwise.hpp"

namespace a2a::moe {

// Lanes of the column sums: lane l adds the tokens l, l + kGateLanes, ... of
// an expert in order, and the lanes' sums are then added in lane order. One
// order, whatever runs it.
constexpr int kGateLanes = 128;

template <typename T>
struct GateEps;
template <>
struct GateEps<float> {
  static constexpr float value = 1.1920928955078125e-07f;  // torch.finfo(float32).eps
};
template <>
struct GateEps<double> {
  static constexpr double value = 2.220446049250313e-16;  // torch.finfo(float64).eps
};
template <>
struct GateEps<half_t> {
  static constexpr float value = 0.0009765625f;  // torch.finfo(float16).eps, 2^-10
};
template <>
struct GateEps<bfloat16_t> {
  static constexpr float value = 0.0078125f;  // torch.finfo(bfloat16).eps, 2^-7
};

// A value of the compute type rounded to T and back: where torch's op on T rounds.
template <typename T>
A2A_HD typename Num<T>::Acc rounded(typename Num<T>::Acc a) {
  return Num<T>::load(Num<T>::store(a));
}

#if defined(__CUDA_ARCH__)
A2A_HD float product(float a, float b) { return __fmul_rn(a, b); }
A2A_HD double product(double a, double b) { return __dmul_rn(a, b); }
A2A_HD float gate_exp(float x) { return expf(x); }
A2A_HD double gate_exp(double x) { return exp(x); }
#else
A2A_HD float product(float a, float b) { return a * b; }
A2A_HD double product(double a, double b) { return a * b; }
A2A_HD float gate_exp(float x) { return std::exp(x); }
A2A_HD double gate_exp(double x) { return std::exp(x); }
#endif

// One token: scores (E) from its logits (E), then its k choices and gates.
// The softmax subtracts the row's maximum (a NaN anywhere makes every score
// NaN, as torch's softmax does).
template <typename T>
A2A_HD void top_k_gate_row(const T* logits, int64_t num_experts, int64_t top_k, bool normalize, T* scores,
                           int64_t* indices, T* gates) {
  using A = typename Num<T>::Acc;
  A top = Num<T>::load(logits[0]);
  for (int64_t e = 1; e < num_experts; ++e) {
    const A v = Num<T>::load(logits[e]);
    if (top == top && (v > top || v != v)) top = v;
  }
  A sum = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const A v = gate_exp(Num<T>::load(logits[e]) - top);
    if constexpr (std::is_same_v<T, A>) scores[e] = v;  // kept for the division; a 16-bit score computes it again
    sum += v;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if constexpr (std::is_same_v<T, A>)
      scores[e] = scores[e] / sum;
    else
      scores[e] = Num<T>::store(gate_exp(Num<T>::load(logits[e]) - top) / sum);
  }
  // A row's scores are all NaN (a NaN or an infinity among its logits, or
  // every logit -inf) or none is. NaN ranks above every number, and equal
  // scores rank by the lower expert: a NaN row chooses 0, 1, ..., k - 1.
  if (sum != sum) {
    for (int64_t j = 0; j < top_k; ++j) indices[j] = j;
  } else {
    // The choices are of the logits, whose order the softmax keeps (and a
    // 16-bit score's rounding would blur: equal scores of unequal logits).
    // One pass over the experts keeps the best k so far in order, their
    // logits in `gates` for now: an expert enters where it beats a kept one
    // strictly, so of equal logits the lower expert (met first) stays first.
    int64_t kept = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const A v = Num<T>::load(logits[e]);
      if (kept == top_k && !(v > Num<T>::load(gates[top_k - 1]))) continue;
      int64_t at = kept < top_k ? kept++ : top_k - 1;
      for (; at > 0 && v > Num<T>::load(gates[at - 1]); --at) {
        gates[at] = gates[at - 1];
        indices[at] = indices[at - 1];
      }
      gates[at] = logits[e];
      indices[at] = e;
    }
  }
  A chosen_sum = 0;
  for (int64_t j = 0; j < top_k; ++j) gates[j] = scores[indices[j]];
  for (int64_t j = 0; j < top_k; ++j) chosen_sum += Num<T>::load(gates[j]);
  if (normalize) {
    const A sum_k = rounded<T>(chosen_sum);
    const A denominator = sum_k < A(GateEps<T>::value) ? A(GateEps<T>::value) : sum_k;  // NaN stays NaN
    for (int64_t j = 0; j < top_k; ++j) gates[j] = Num<T>::store(Num<T>::load(gates[j]) / denominator);
  }
}

// A float64 value (the share, the loss) stored as T.
template <typename T>
A2A_HD T from_double(double v) {
  return Num<T>::store(static_cast<typename Num<T>::Acc>(v));
}

// The share of first choices of an expert, stored as T: firsts / tokens (0 without tokens).
template <typename T>
A2A_HD T gate_share(int64_t firsts, int64_t num_tokens) {
  return from_double<T>(num_tokens == 0 ? 0.0 : static_cast<double>(firsts) / static_cast<double>(num_tokens));
}

// The loss's part of every dscores[e], over share[e]: dl_aux * E / tokens (0 where no gradient reached the loss).
template <typename T>
A2A_HD typename Num<T>::Acc gate_loss_scale(const T* d_l_aux, int64_t num_experts, int64_t num_tokens) {
  using A = typename Num<T>::Acc;
  return d_l_aux == nullptr ? A(0) : product(Num<T>::load(*d_l_aux), A(num_experts) / A(num_tokens));
}

// Lane `lane`'s part of expert e's column: the sum (in double) of its scores
// over the tokens lane, lane + kGateLanes, ..., and how many of those tokens
// chose e first.
template <typename T>
A2A_HD void gate_column_lane(const T* scores, const int64_t* indices, int64_t num_tokens, int64_t num_experts,
                             int64_t top_k, int64_t e, int lane, double* sum, int64_t* firsts) {
  double s = 0;
  int64_t n = 0;
  for (int64_t t = lane; t < num_tokens; t += kGateLanes) {
    s += static_cast<double>(Num<T>::load(scores[t * num_experts + e]));
    n += indices[t * top_k] == e ? 1 : 0;
  }
  *sum = s;
  *firsts = n;
}

// GShard's loss from every expert's column sum (lanes added in order) and
// first-choice count: E * sum_e (sum_e / T) * (firsts_e / T), in double.
// 0 without tokens.
A2A_HD double gshard_loss_of_columns(const double* column_sums, const int64_t* firsts, int64_t num_tokens,
                                     int64_t num_experts) {
  if (num_tokens == 0) return 0;
  const double tokens = static_cast<double>(num_tokens);
  double loss = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    loss += product(column_sums[e] / tokens, static_cast<double>(firsts[e]) / tokens);
  return product(loss, static_cast<double>(num_experts));
}

// One token's gradient of the logits (E). d_gates (k) may be NULL (no
// gradient reached the gates); loss_scale is dl_aux * E / tokens (0 when no
// gradient reached the loss), share (E) the forward's. False, and a row of
// NaN, where the indices are not k distinct experts (not the forward's).
// Nothing is kept between the passes but scalars (a 16-bit output is rounded
// once): with ds[e] = share[e] * loss_scale + (dr_j where e = indices[j]),
//     <ds, scores> = sum_e share[e] loss_scale scores[e] + sum_j dr_j scores[indices[j]]
template <typename T>
A2A_HD bool top_k_gate_backward_row(const T* scores, const int64_t* indices, const T* d_gates, const T* share,
                                    typename Num<T>::Acc loss_scale, int64_t num_experts, int64_t top_k,
                                    bool normalize, T* d_logits) {
  using A = typename Num<T>::Acc;
  for (int64_t j = 0; j < top_k; ++j) {  // not the forward's (k distinct experts): no read out of bounds
    bool bad = indices[j] < 0 || indices[j] >= num_experts;
    for (int64_t i = 0; i < j; ++i) bad = bad || indices[i] == indices[j];
    if (bad) {
      for (int64_t e = 0; e < num_experts; ++e) d_logits[e] = Num<T>::store(A(0) / A(0));
      return false;
    }
  }
  // The gates' part: dr_j = (dg_j - dot) / denominator, dot = <dg, gates> unless the clamp held.
  A denominator = 1, gates_dot = 0;
  if (d_gates != nullptr && normalize) {
    A chosen_sum = 0;
    for (int64_t j = 0; j < top_k; ++j) chosen_sum += Num<T>::load(scores[indices[j]]);
    chosen_sum = rounded<T>(chosen_sum);
    denominator = chosen_sum < A(GateEps<T>::value) ? A(GateEps<T>::value) : chosen_sum;
    for (int64_t j = 0; j < top_k; ++j)
      gates_dot += product(Num<T>::load(d_gates[j]), Num<T>::load(scores[indices[j]]) / denominator);
    if (chosen_sum < denominator) gates_dot = 0;  // the clamp held the denominator: no gradient through it
  }
  const auto dr = [&](int64_t j) -> A {
    if (d_gates == nullptr) return A(0);
    const A dg = Num<T>::load(d_gates[j]);
    return normalize ? (dg - gates_dot) / denominator : dg;
  };
  A dot = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    dot += product(product(Num<T>::load(share[e]), loss_scale), Num<T>::load(scores[e]));
  for (int64_t j = 0; j < top_k; ++j) dot += product(dr(j), Num<T>::load(scores[indices[j]]));
  for (int64_t e = 0; e < num_experts; ++e) {
    const A s = Num<T>::load(scores[e]);
    d_logits[e] = Num<T>::store(product(s, product(Num<T>::load(share[e]), loss_scale) - dot));
  }
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t e = indices[j];
    const A s = Num<T>::load(scores[e]);
    d_logits[e] = Num<T>::store(product(s, (product(Num<T>::load(share[e]), loss_scale) + dr(j)) - dot));
  }
  return true;
}

}  // namespace a2a::moe
