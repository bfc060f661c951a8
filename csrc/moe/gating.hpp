// Per-row logic of the fused top-k gate (a2a_top_k_gate and its backward),
// shared by the CPU backend (cpu/gating_cpu.cpp) and the CUDA one
// (cuda/gating_cuda.cu), so that both take the same steps in the same order.
// A row is one token's E logits; T is the compute type, float for float32
// logits and double for float64.
//
//   forward:  scores  = softmax(logits)                     (E)
//             indices = the k largest scores, best first; equal scores by the
//                       lower expert, NaN above every number  (k)
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

#if !defined(__CUDACC__)
#include <cmath>
#endif

#include "core/half.hpp"

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
  T top = logits[0];
  for (int64_t e = 1; e < num_experts; ++e) {
    const T v = logits[e];
    if (top == top && (v > top || v != v)) top = v;
  }
  T sum = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const T v = gate_exp(logits[e] - top);
    scores[e] = v;
    sum += v;
  }
  for (int64_t e = 0; e < num_experts; ++e) scores[e] = scores[e] / sum;
  // A row's scores are all NaN (a NaN or an infinity among its logits, or
  // every logit -inf) or none is. NaN ranks above every number, and equal
  // scores rank by the lower expert: a NaN row chooses 0, 1, ..., k - 1.
  T chosen_sum = 0;
  if (sum != sum) {
    for (int64_t j = 0; j < top_k; ++j) {
      indices[j] = j;
      gates[j] = scores[j];
      chosen_sum += scores[j];
    }
  } else {
    // One pass over the experts, keeping the best k so far in order: an
    // expert enters where it beats a kept one strictly, so of equal scores the
    // lower expert (met first) stays first.
    int64_t kept = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const T v = scores[e];
      if (kept == top_k && !(v > gates[top_k - 1])) continue;
      int64_t at = kept < top_k ? kept++ : top_k - 1;
      for (; at > 0 && v > gates[at - 1]; --at) {
        gates[at] = gates[at - 1];
        indices[at] = indices[at - 1];
      }
      gates[at] = v;
      indices[at] = e;
    }
    for (int64_t j = 0; j < top_k; ++j) chosen_sum += gates[j];
  }
  if (normalize) {
    const T denominator = chosen_sum < GateEps<T>::value ? GateEps<T>::value : chosen_sum;  // NaN stays NaN
    for (int64_t j = 0; j < top_k; ++j) gates[j] = gates[j] / denominator;
  }
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
    s += static_cast<double>(scores[t * num_experts + e]);
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
// NaN, where an index is not an expert (indices that are not the forward's).
template <typename T>
A2A_HD bool top_k_gate_backward_row(const T* scores, const int64_t* indices, const T* d_gates, const T* share,
                                    T loss_scale, int64_t num_experts, int64_t top_k, bool normalize, T* d_logits) {
  for (int64_t j = 0; j < top_k; ++j) {
    if (indices[j] < 0 || indices[j] >= num_experts) {  // not the forward's: no read out of bounds
      for (int64_t e = 0; e < num_experts; ++e) d_logits[e] = T(0) / T(0);
      return false;
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) d_logits[e] = product(share[e], loss_scale);
  if (d_gates != nullptr) {
    T chosen_sum = 0;
    for (int64_t j = 0; j < top_k; ++j) chosen_sum += scores[indices[j]];
    T denominator = 1, dot = 0;
    if (normalize) {
      denominator = chosen_sum < GateEps<T>::value ? GateEps<T>::value : chosen_sum;
      for (int64_t j = 0; j < top_k; ++j) dot += product(d_gates[j], scores[indices[j]] / denominator);
      if (chosen_sum < denominator) dot = 0;  // the clamp held the denominator: no gradient through it
    }
    for (int64_t j = 0; j < top_k; ++j) {
      const T dr = normalize ? (d_gates[j] - dot) / denominator : d_gates[j];
      d_logits[indices[j]] = dr + d_logits[indices[j]];
    }
  }
  T dot = 0;
  for (int64_t e = 0; e < num_experts; ++e) dot += product(d_logits[e], scores[e]);
  for (int64_t e = 0; e < num_experts; ++e) d_logits[e] = product(scores[e], d_logits[e] - dot);
  return true;
}

}  // namespace a2a::moe
