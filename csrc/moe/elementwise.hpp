// Per-element logic of the MoE kernels, shared by the CPU backend (plain C++)
// and the CUDA backend (nvcc, as __host__ __device__ functions), so a CPU test
// exercises the arithmetic the GPU runs: the accumulator type of each dtype
// (over the float16 / bfloat16 conversions of core/half.hpp), index loads,
// and which row of the dispatched buffer a (token, choice) occupies.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"
#include "core/half.hpp"

namespace a2a::moe {

// Numeric traits per storage type: the accumulator (float for 16- and 32-bit
// floats, double for double) and the conversions to and from it.
template <typename T>
struct Num;

template <>
struct Num<float> {
  using Acc = float;
  A2A_HD static Acc load(float v) { return v; }
  A2A_HD static float store(Acc a) { return a; }
};
template <>
struct Num<double> {
  using Acc = double;
  A2A_HD static Acc load(double v) { return v; }
  A2A_HD static double store(Acc a) { return a; }
};
template <>
struct Num<half_t> {
  using Acc = float;
  A2A_HD static Acc load(half_t v) { return half_to_float(v.bits); }
  A2A_HD static half_t store(Acc a) { return half_t{float_to_half(a)}; }
};
template <>
struct Num<bfloat16_t> {
  using Acc = float;
  A2A_HD static Acc load(bfloat16_t v) { return bfloat16_to_float(v.bits); }
  A2A_HD static bfloat16_t store(Acc a) { return bfloat16_t{float_to_bfloat16(a)}; }
};

// Element i of an int32 or int64 index array.
A2A_HD int64_t load_index(const void* indices, a2a_dtype_t index_dtype, int64_t i) {
  return index_dtype == A2A_INT32 ? static_cast<int64_t>(static_cast<const int32_t*>(indices)[i])
                                  : static_cast<const int64_t*>(indices)[i];
}

// The choice (flat index t * k + j) at position p of Tutel's slot order: all
// first choices, then all second choices, ...; within one choice, tokens in
// token_order (or in order).
A2A_HD int64_t choice_at(int64_t position, int64_t num_tokens, int64_t top_k, const int64_t* token_order) {
  const int64_t j = position / num_tokens;
  const int64_t r = position - j * num_tokens;
  const int64_t t = token_order ? token_order[r] : r;
  return t * top_k + j;
}

// Row of the dispatched buffer that choice i = t * k + j occupies, or -1 when
// it is not routed or was dropped (its location is past its expert's count).
A2A_HD int64_t kept_row(const a2a_routing_t& routing, int64_t choice) {
  const int64_t expert = load_index(routing.indices, routing.index_dtype, choice);
  if (expert < 0) return -1;
  const int64_t location = routing.locations[choice];
  if (location < 0 || location >= routing.counts[expert]) return -1;
  return routing.expert_offsets[expert] + location;
}

// Expert that owns row `row` (0 <= row < num_rows) of a padded layout: row / C
// for one capacity, else the last e with expert_offsets[e] <= row (per-expert
// capacities; an expert of capacity 0 owns no row, and is skipped).
A2A_HD int64_t expert_of_row(const a2a_routing_t& routing, int64_t row) {
  if (routing.capacity > 0) return row / routing.capacity;
  int64_t low = 0, high = routing.num_experts;  // expert_offsets[low] <= row < expert_offsets[high]
  while (high - low > 1) {
    const int64_t middle = low + (high - low) / 2;
    if (routing.expert_offsets[middle] <= row)
      low = middle;
    else
      high = middle;
  }
  return low;
}

// Gate of choice i as the accumulator type (1 when there are no gates).
// gate_is_data: the gates have the data's storage type T, else float32.
template <typename T>
A2A_HD typename Num<T>::Acc load_gate(const void* gates, bool gate_is_data, int64_t choice) {
  using Acc = typename Num<T>::Acc;
  if (gates == nullptr) return Acc(1);
  if (gate_is_data) return Num<T>::load(static_cast<const T*>(gates)[choice]);
  return static_cast<Acc>(static_cast<const float*>(gates)[choice]);
}

// Stores an accumulated gate gradient as the gates' dtype.
template <typename T>
A2A_HD void store_gate(void* grad_gates, bool gate_is_data, int64_t choice, typename Num<T>::Acc value) {
  if (gate_is_data)
    static_cast<T*>(grad_gates)[choice] = Num<T>::store(value);
  else
    static_cast<float*>(grad_gates)[choice] = static_cast<float>(value);
}

// The low-latency dispatch sends a token one row per distinct expert of its
// choices: the first choice of token t before j that names the same expert
// as choice j (whose row serves both), or -1 when j is the first.
A2A_HD int64_t earlier_same_expert(const void* indices, a2a_dtype_t index_dtype, int64_t t, int64_t j,
                                   int64_t top_k, int64_t expert) {
  for (int64_t i = 0; i < j; ++i)
    if (load_index(indices, index_dtype, t * top_k + i) == expert) return t * top_k + i;
  return -1;
}

// Row of an expert-specific operand that choice c = t * k + j reads: t for
// an operand by token, c for one by choice.
A2A_HD int64_t es_row(a2a_es_rows_t rows, int64_t choice, int64_t top_k) {
  return rows == A2A_ES_ROWS_TOKEN ? choice / top_k : choice;
}

}  // namespace a2a::moe
