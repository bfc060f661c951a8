// CPU backend of the MoE kernels: threads over tokens (cpu/thread_pool), with
// the per-element arithmetic of moe/elementwise.hpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "cpu/bf16_avx2.hpp"
#include "cpu/es_cpu.hpp"
#include "cpu/fp8_cpu.hpp"
#include "cpu/gating_cpu.hpp"
#include "cpu/low_latency_cpu.hpp"
#include "cpu/thread_pool.hpp"
#include "moe/elementwise.hpp"
#include "moe/kernels.hpp"
#include "moe/messages.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define A2A_X86_ROWS 1
#endif

namespace a2a::moe {

namespace {

using cpu::default_num_threads;
using cpu::grain_for;
using cpu::parallel_for;
using cpu::slice_count;

// Choices per slice of the location scan.
constexpr int64_t kScanGrain = 1 << 14;
// Elements per L1 block: accumulators in combine, staging for non-temporal stores.
constexpr int64_t kBlock = 512;

// The per-row loops. On x86-64 each is compiled twice: for the baseline ISA
// and, through the `flatten` wrappers below, for AVX2 (picked at run time).
// Both run the same per-element operations in the same order, so they give
// the same bits. Rows of big outputs go through an L1 block and non-temporal
// stores, as a large memcpy does: the output is not read back soon, and
// ordinary stores would first read every destination line.

// Outputs larger than this (bytes) are written with non-temporal stores.
constexpr size_t kStreamingBytes = size_t{32} << 20;

#ifdef A2A_X86_ROWS
// Copies from an L1 block to memory with 16-byte non-temporal stores.
__attribute__((target("avx2"))) inline void stream_copy(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
}
#endif

// Writes the m elements computed by produce(block) to out, directly or
// through a block and non-temporal stores.
template <typename T, bool kStream, typename Produce>
inline void write_block(T* __restrict out, int64_t m, Produce&& produce) {
#ifdef A2A_X86_ROWS
  if constexpr (kStream) {
    T block[kBlock];
    produce(block);
    stream_copy(out, block, static_cast<size_t>(m) * sizeof(T));
    return;
  }
#endif
  produce(out);
}

// dst[i] = gate * src[i], formed in the accumulator type.
template <typename T, bool kStream>
void scale_row(T* __restrict dst, const T* __restrict src, typename Num<T>::Acc gate, int64_t n) {
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    write_block<T, kStream>(dst + base, m, [&](T* __restrict out) {
      for (int64_t i = 0; i < m; ++i) out[i] = Num<T>::store(gate * Num<T>::load(src[base + i]));
    });
  }
}

// out[i] = sum over s < K of weights[s] * sources[s][i], accumulated from 0
// in order, for a fixed number of sources: the sum stays in registers.
template <typename T, int K, bool kStream>
void weighted_sum_fixed(T* __restrict out, const T* const* sources, const typename Num<T>::Acc* weights, int64_t n) {
  using Acc = typename Num<T>::Acc;
  const T* src[K];
  Acc g[K];
  for (int s = 0; s < K; ++s) {
    src[s] = sources[s];
    g[s] = weights[s];
  }
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    write_block<T, kStream>(out + base, m, [&](T* __restrict dst) {
      for (int64_t i = 0; i < m; ++i) {
        Acc acc = Acc(0);
        for (int s = 0; s < K; ++s) acc += g[s] * Num<T>::load(src[s][base + i]);
        dst[i] = Num<T>::store(acc);
      }
    });
  }
}

// out[i] = sum over s of weights[s] * sources[s][i], accumulated from 0 in
// order: fixed-count loops for up to 4 sources, else through an L1-sized
// block of accumulators (same order, same bits).
template <typename T, bool kStream>
void weighted_sum_row(T* __restrict out, const T* const* sources, const typename Num<T>::Acc* weights, int64_t count,
                      int64_t n) {
  using Acc = typename Num<T>::Acc;
  switch (count) {
    case 1: return weighted_sum_fixed<T, 1, kStream>(out, sources, weights, n);
    case 2: return weighted_sum_fixed<T, 2, kStream>(out, sources, weights, n);
    case 3: return weighted_sum_fixed<T, 3, kStream>(out, sources, weights, n);
    case 4: return weighted_sum_fixed<T, 4, kStream>(out, sources, weights, n);
    default: break;
  }
  Acc acc[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    for (int64_t i = 0; i < m; ++i) acc[i] = Acc(0);
    for (int64_t s = 0; s < count; ++s) {
      const T* __restrict src = sources[s] + base;
      const Acc g = weights[s];
      for (int64_t i = 0; i < m; ++i) acc[i] += g * Num<T>::load(src[i]);
    }
    write_block<T, kStream>(out + base, m, [&](T* __restrict dst) {
      for (int64_t i = 0; i < m; ++i) dst[i] = Num<T>::store(acc[i]);
    });
  }
}

// Sum of a[i] * b[i] in Acc, over 8 independent partial sums (which lets
// the compiler vectorize without reassociating a single chain).
template <typename T>
typename Num<T>::Acc dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  using Acc = typename Num<T>::Acc;
  constexpr int kLanes = 8;
  Acc partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) partial[l] += Num<T>::load(a[i + l]) * Num<T>::load(b[i + l]);
  Acc sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  for (; i < n; ++i) sum += Num<T>::load(a[i]) * Num<T>::load(b[i]);
  return sum;
}

// Copies a row (gate 1, kept bit for bit, NaN payloads included).
template <bool kStream>
void copy_row(void* dst, const void* src, size_t bytes) {
#ifdef A2A_X86_ROWS
  if constexpr (kStream) return stream_copy(dst, src, bytes);
#endif
  std::memcpy(dst, src, bytes);
}

#ifdef A2A_X86_ROWS
// Rows of bfloat16 written by 16-element vectors: with kStream, a head of
// scalar elements up to a 32-byte boundary, then non-temporal vector stores.
// element(i, &lo, &hi) computes elements i..i+15 as floats; scalar(i) one.
template <bool kStream, typename Vector, typename Scalar>
__attribute__((target("avx2"), always_inline)) inline void write_bf16_row(bfloat16_t* dst, int64_t n, Vector&& vector,
                                                                          Scalar&& scalar) {
  int64_t i = 0;
  if (kStream) {
    const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % 32);
    const int64_t head = misaligned % 2 != 0 ? n : std::min(n, (32 - misaligned) % 32 / 2);
    for (; i < head; ++i) dst[i] = scalar(i);
  }
  for (; i + 16 <= n; i += 16) {
    __m256 lo, hi;
    vector(i, &lo, &hi);
    store_bf16x16<kStream>(dst + i, lo, hi);
  }
  for (; i < n; ++i) dst[i] = scalar(i);
}

template <bool kStream>
__attribute__((target("avx2"))) void scale_row_bf16_avx2(bfloat16_t* __restrict dst, const bfloat16_t* __restrict src,
                                                         float gate, int64_t n) {
  const __m256 g = _mm256_set1_ps(gate);
  write_bf16_row<kStream>(
      dst, n,
      [&](int64_t i, __m256* lo, __m256* hi) __attribute__((target("avx2"), always_inline)) {
        load_bf16x16(src + i, lo, hi);
        *lo = _mm256_mul_ps(g, *lo);
        *hi = _mm256_mul_ps(g, *hi);
      },
      [&](int64_t i) { return Num<bfloat16_t>::store(gate * Num<bfloat16_t>::load(src[i])); });
}

template <int K, bool kStream>
__attribute__((target("avx2"))) void weighted_sum_bf16_avx2(bfloat16_t* __restrict out,
                                                            const bfloat16_t* const* sources, const float* weights,
                                                            int64_t n) {
  const bfloat16_t* src[K];
  __m256 g[K];
  for (int s = 0; s < K; ++s) {
    src[s] = sources[s];
    g[s] = _mm256_set1_ps(weights[s]);
  }
  write_bf16_row<kStream>(
      out, n,
      [&](int64_t i, __m256* lo, __m256* hi) __attribute__((target("avx2"), always_inline)) {
        *lo = _mm256_setzero_ps();  // from +0, sources in order, as the scalar loop
        *hi = _mm256_setzero_ps();
        for (int s = 0; s < K; ++s) {
          __m256 a, b;
          load_bf16x16(src[s] + i, &a, &b);
          *lo = _mm256_add_ps(*lo, _mm256_mul_ps(g[s], a));
          *hi = _mm256_add_ps(*hi, _mm256_mul_ps(g[s], b));
        }
      },
      [&](int64_t i) {
        float acc = 0.0f;
        for (int s = 0; s < K; ++s) acc += weights[s] * Num<bfloat16_t>::load(src[s][i]);
        return Num<bfloat16_t>::store(acc);
      });
}

// AVX2 only (no FMA: a fused multiply-add would round differently).
template <typename T, bool kStream>
__attribute__((target("avx2"), flatten)) void scale_row_avx2(T* __restrict dst, const T* __restrict src,
                                                              typename Num<T>::Acc gate, int64_t n) {
  if constexpr (std::is_same_v<T, bfloat16_t>)
    scale_row_bf16_avx2<kStream>(dst, src, gate, n);
  else
    scale_row<T, kStream>(dst, src, gate, n);
}
template <typename T, bool kStream>
__attribute__((target("avx2"), flatten)) void weighted_sum_row_avx2(T* __restrict out, const T* const* sources,
                                                                     const typename Num<T>::Acc* weights,
                                                                     int64_t count, int64_t n) {
  if constexpr (std::is_same_v<T, bfloat16_t>) {
    switch (count) {
      case 1: return weighted_sum_bf16_avx2<1, kStream>(out, sources, weights, n);
      case 2: return weighted_sum_bf16_avx2<2, kStream>(out, sources, weights, n);
      case 3: return weighted_sum_bf16_avx2<3, kStream>(out, sources, weights, n);
      case 4: return weighted_sum_bf16_avx2<4, kStream>(out, sources, weights, n);
      default: break;
    }
  }
  weighted_sum_row<T, kStream>(out, sources, weights, count, n);
}
template <typename T>
__attribute__((target("avx2"), flatten)) typename Num<T>::Acc dot_avx2(const T* __restrict a, const T* __restrict b,
                                                                        int64_t n) {
  return dot<T>(a, b, n);
}
bool has_avx2() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}
#endif

// The row loops for this CPU and an output of `output_bytes`.
template <typename T>
struct RowKernels {
  decltype(&scale_row<T, false>) scale = scale_row<T, false>;
  decltype(&weighted_sum_row<T, false>) weighted_sum = weighted_sum_row<T, false>;
  decltype(&dot<T>) dot_product = dot<T>;
  decltype(&copy_row<false>) copy = copy_row<false>;

  explicit RowKernels(size_t output_bytes) {
#ifdef A2A_X86_ROWS
    if (!has_avx2()) return;
    dot_product = dot_avx2<T>;
    if (output_bytes >= kStreamingBytes) {
      scale = scale_row_avx2<T, true>;
      weighted_sum = weighted_sum_row_avx2<T, true>;
      copy = copy_row<true>;
    } else {
      scale = scale_row_avx2<T, false>;
      weighted_sum = weighted_sum_row_avx2<T, false>;
    }
#else
    (void)output_bytes;
#endif
  }

  // Non-temporal stores are weakly ordered: fence them before the slice
  // reports completion to the thread that waits for it.
  static void finish() {
#ifdef A2A_X86_ROWS
    _mm_sfence();
#endif
  }
};

template <typename T>
void dispatch_typed(const a2a_routing_t& r, const T* x, int64_t model_dim, const void* gates, bool gate_is_data,
                    T* rows, int num_threads) {
  const int64_t k = r.top_k;
  const size_t row_bytes = static_cast<size_t>(model_dim) * sizeof(T);
  const RowKernels<T> kernels(static_cast<size_t>(r.num_rows) * row_bytes);
  parallel_for(r.num_tokens, grain_for(k * model_dim), num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* src = x + t * model_dim;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t choice = t * k + j;
        const int64_t row = kept_row(r, choice);
        if (row < 0) continue;
        T* dst = rows + row * model_dim;
        if (gates == nullptr)
          kernels.copy(dst, src, row_bytes);
        else
          kernels.scale(dst, src, load_gate<T>(gates, gate_is_data, choice), model_dim);
      }
    }
    kernels.finish();
  });
  if (r.capacity == A2A_CAPACITY_DROPLESS) return;  // no padding rows
  // Expert e's padding is one contiguous block of rows after its kept ones, up
  // to the next expert's first row (one capacity, or per-expert capacities).
  const int64_t rows_per_expert = r.num_rows / r.num_experts;
  parallel_for(r.num_experts, grain_for(rows_per_expert * model_dim), num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t first = r.expert_offsets[e] + r.counts[e];
      const int64_t last = r.expert_offsets[e + 1];
      if (last > first) std::memset(rows + first * model_dim, 0, static_cast<size_t>(last - first) * row_bytes);
    }
  });
}

template <typename T>
void combine_typed(const a2a_routing_t& r, const T* rows, int64_t model_dim, const void* gates, bool gate_is_data,
                   T* y, int num_threads) {
  using Acc = typename Num<T>::Acc;
  const int64_t k = r.top_k;
  const RowKernels<T> kernels(static_cast<size_t>(r.num_tokens) * static_cast<size_t>(model_dim) * sizeof(T));
  parallel_for(r.num_tokens, grain_for(k * model_dim), num_threads, [&](int64_t begin, int64_t end) {
    std::vector<const T*> sources(static_cast<size_t>(k));
    std::vector<Acc> weights(static_cast<size_t>(k));
    for (int64_t t = begin; t < end; ++t) {
      int64_t kept = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = kept_row(r, t * k + j);
        if (row < 0) continue;
        sources[kept] = rows + row * model_dim;
        weights[kept] = load_gate<T>(gates, gate_is_data, t * k + j);
        ++kept;
      }
      kernels.weighted_sum(y + t * model_dim, sources.data(), weights.data(), kept, model_dim);
    }
    kernels.finish();
  });
}

template <typename T>
void gate_grad_typed(const a2a_routing_t& r, const T* tokens, const T* rows, int64_t model_dim, bool gate_is_data,
                     void* grad_gates, int num_threads) {
  const int64_t k = r.top_k;
  const RowKernels<T> kernels(0);  // only dot products
  parallel_for(r.num_tokens, grain_for(k * model_dim), num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t choice = t * k + j;
        const int64_t row = kept_row(r, choice);
        const typename Num<T>::Acc value =
            row < 0 ? 0 : kernels.dot_product(tokens + t * model_dim, rows + row * model_dim, model_dim);
        store_gate<T>(grad_gates, gate_is_data, choice, value);
      }
    }
  });
}

class CpuKernels final : public Kernels {
 public:
  explicit CpuKernels(int num_threads) : threads_(num_threads > 0 ? num_threads : default_num_threads()) {}
  const char* name() const override { return "cpu"; }

  size_t locate_workspace_size(int64_t num_tokens, int64_t top_k, int64_t num_experts) const override {
    const int slices = std::max(1, slice_count(num_tokens * top_k, kScanGrain, threads_));
    // The fixed-capacity route's result, then per-slice expert histograms,
    // then one byte per token for the token_order check.
    return sizeof(FixedResult) + static_cast<size_t>(slices) * static_cast<size_t>(num_experts) * sizeof(int64_t) +
           static_cast<size_t>(num_tokens);
  }

  void locate(const RouteProblem& p, void* workspace, size_t /*workspace_bytes: checked by moe/moe.cpp*/,
              int64_t* locations, std::vector<int64_t>& demand) override {
    ScanFault fault;
    scan(p, workspace, locations, demand, fault);
    raise_scan_fault(fault, p.num_tokens, p.top_k, p.num_experts);
  }

  void locate_fixed(const RouteProblem& p, void* workspace, size_t /*workspace_bytes: checked by moe/moe.cpp*/,
                    int64_t capacity, int64_t* locations, int64_t* counts, int64_t* expert_offsets) override {
    const int64_t E = p.num_experts;
    FixedResult result;
    std::vector<int64_t> demand;
    if (!scan(p, workspace, locations, demand, result.fault))  // a bad token_order: nothing is routed
      std::fill(locations, locations + p.num_tokens * p.top_k, -1);
    if (capacity == A2A_CAPACITY_DROPLESS) {  // packed, bounded at T*k rows: nothing dropped
      int64_t next = 0;
      for (int64_t e = 0; e < E; ++e) {
        counts[e] = demand[e];
        expert_offsets[e] = next;
        next += demand[e];
      }
      expert_offsets[E] = p.num_tokens * p.top_k;
    } else {
      for (int64_t e = 0; e < E; ++e) {
        counts[e] = std::min(demand[e], capacity);
        result.dropped += demand[e] - counts[e];
        expert_offsets[e] = e * capacity;
      }
      expert_offsets[E] = E * capacity;
    }
    std::memcpy(workspace, &result, sizeof result);
  }

  std::pair<ScanFault, int64_t> fixed_result(const void* workspace) override {
    FixedResult result;
    std::memcpy(&result, workspace, sizeof result);
    return {result.fault, result.dropped};
  }

  void upload(void* dst, const void* host_src, size_t bytes) override {
    if (bytes != 0 && dst != host_src) std::memmove(dst, host_src, bytes);
  }

  void dispatch(const a2a_routing_t& r, const void* x, a2a_dtype_t dtype, int64_t model_dim, const void* gates,
                a2a_dtype_t gate_dtype, void* rows) override {
    with_float_type("dispatch", dtype, [&](auto tag) {
      using T = decltype(tag);
      dispatch_typed<T>(r, static_cast<const T*>(x), model_dim, gates, gate_dtype == dtype, static_cast<T*>(rows),
                        threads_);
    });
  }

  void combine(const a2a_routing_t& r, const void* rows, a2a_dtype_t dtype, int64_t model_dim, const void* gates,
               a2a_dtype_t gate_dtype, void* y) override {
    with_float_type("combine", dtype, [&](auto tag) {
      using T = decltype(tag);
      combine_typed<T>(r, static_cast<const T*>(rows), model_dim, gates, gate_dtype == dtype, static_cast<T*>(y),
                       threads_);
    });
  }

  void gate_grad(const a2a_routing_t& r, const void* tokens, const void* rows, a2a_dtype_t dtype, int64_t model_dim,
                 a2a_dtype_t gate_dtype, void* grad_gates) override {
    with_float_type("gate_grad", dtype, [&](auto tag) {
      using T = decltype(tag);
      gate_grad_typed<T>(r, static_cast<const T*>(tokens), static_cast<const T*>(rows), model_dim,
                         gate_dtype == dtype, grad_gates, threads_);
    });
  }

  void es_scatter_slots(const RouteProblem& problem, const int64_t* locations, const int64_t* expert_starts,
                        int64_t num_slots, int64_t* slots) override {
    es_scatter_slots_cpu(problem, locations, expert_starts, num_slots, slots);
  }
  void esmm(const a2a_es_index_t& index, const EsMatmul& problem) override { esmm_cpu(index, problem, threads_); }
  void ess(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, a2a_dtype_t dtype,
           void* out) override {
    ess_cpu(index, x, gates, dtype, out, threads_);
  }
  void estmm(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates,
             a2a_dtype_t dtype, void* out) override {
    estmm_cpu(index, a, b, gates, dtype, out, threads_);
  }
  void top_k_gate(const a2a_top_k_gate_t& gate, const void* logits, void* scores, int64_t* indices, void* gates,
                  void* share, void* l_aux, void* workspace) override {
    top_k_gate_cpu(gate, logits, scores, indices, gates, share, l_aux, workspace, threads_);
  }
  void top_k_gate_backward(const a2a_top_k_gate_t& gate, const void* scores, const int64_t* indices,
                           const void* share, const void* d_gates, const void* d_l_aux, void* d_logits) override {
    top_k_gate_backward_cpu(gate, scores, indices, share, d_gates, d_l_aux, d_logits, threads_);
  }
  void quantize_fp8(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows) override {
    quantize_fp8_cpu(x, dtype, rows, threads_);
  }
  void dequantize_fp8(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y) override {
    dequantize_fp8_cpu(rows, dtype, y, threads_);
  }
  void low_latency_pack(const LowLatencyLayout& l, const void* x, int64_t num_tokens, const void* indices,
                        a2a_dtype_t index_dtype, uint32_t sequence, char* workspace, int64_t* sent) override {
    low_latency_pack_cpu(l, x, num_tokens, indices, index_dtype, sequence, workspace, sent);
  }
  void low_latency_reject(const LowLatencyLayout& l, uint32_t kind, uint32_t sequence, char* workspace) override {
    low_latency_reject_cpu(l, kind, sequence, workspace);
  }
  void low_latency_unpack(const LowLatencyLayout& l, uint32_t sequence, char* workspace, void* recv,
                          int64_t* recv_counts, int64_t* received) override {
    low_latency_unpack_cpu(l, sequence, workspace, recv, recv_counts, received);
  }
  void low_latency_return(const LowLatencyLayout& l, const void* expert_out, uint32_t sequence,
                          char* workspace) override {
    low_latency_return_cpu(l, expert_out, sequence, workspace);
  }
  void low_latency_combine(const LowLatencyLayout& l, int64_t num_tokens, const void* gates, a2a_dtype_t gate_dtype,
                           uint32_t sequence, char* workspace, void* y, const int64_t* sent) override {
    low_latency_combine_cpu(l, num_tokens, gates, gate_dtype, sequence, workspace, y, sent);
  }
  LowLatencyStatus low_latency_status(const LowLatencyLayout&, const char*) override { return {}; }

 private:
  // Runs body(s) for each of `slices` slices, one per thread.
  void run_slices(int slices, const std::function<void(int)>& body) {
    parallel_for(slices, 1, slices, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) body(static_cast<int>(s));
    });
  }

  // What a fixed-capacity route leaves at the head of the workspace.
  struct FixedResult {
    ScanFault fault;
    int64_t dropped = 0;
  };

  // The location scan (see Kernels::locate) into locations and demand; what
  // is wrong goes to `fault`. An index >= E is not routed; with a bad
  // token_order nothing is scanned (demand 0, locations untouched): false.
  bool scan(const RouteProblem& p, void* workspace, int64_t* locations, std::vector<int64_t>& demand,
            ScanFault& fault) {
    const int64_t T = p.num_tokens, k = p.top_k, E = p.num_experts, n = T * k;
    const int slices = std::max(1, slice_count(n, kScanGrain, threads_));
    int64_t* histogram = reinterpret_cast<int64_t*>(static_cast<unsigned char*>(workspace) + sizeof(FixedResult));
    demand.assign(static_cast<size_t>(E), 0);
    if (p.token_order != nullptr &&
        !token_order_is_permutation(p, reinterpret_cast<unsigned char*>(histogram + slices * E), fault))
      return false;
    std::fill(histogram, histogram + static_cast<size_t>(slices) * E, 0);

    // fn(choice, expert) for the positions of slice s, in slot order.
    auto walk = [&](int s, auto&& fn) {
      for (int64_t pos = n * s / slices, end = n * (s + 1) / slices; pos < end; ++pos) {
        const int64_t choice = choice_at(pos, T, k, p.token_order);
        fn(choice, load_index(p.indices, p.index_dtype, choice));
      }
    };
    // Pass 1: per-slice histograms, and the first index out of range.
    std::vector<int64_t> first_bad(static_cast<size_t>(slices), std::numeric_limits<int64_t>::max());
    run_slices(slices, [&](int s) {
      int64_t* counts = histogram + static_cast<int64_t>(s) * E;
      walk(s, [&](int64_t choice, int64_t expert) {
        if (expert >= E)
          first_bad[s] = std::min(first_bad[s], choice);
        else if (expert >= 0)
          ++counts[expert];
      });
    });
    const int64_t bad = *std::min_element(first_bad.begin(), first_bad.end());
    if (bad != std::numeric_limits<int64_t>::max()) {
      fault.bad_choice = bad;
      fault.bad_choice_value = load_index(p.indices, p.index_dtype, bad);
    }
    // Exclusive scan over slices, per expert: each slice's first location.
    for (int s = 0; s < slices; ++s) {
      int64_t* counts = histogram + static_cast<int64_t>(s) * E;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t c = counts[e];
        counts[e] = demand[e];
        demand[e] += c;
      }
    }
    // Pass 2: every slice hands out its locations from its own counters.
    run_slices(slices, [&](int s) {
      int64_t* next = histogram + static_cast<int64_t>(s) * E;
      walk(s, [&](int64_t choice, int64_t expert) {
        locations[choice] = expert >= 0 && expert < E ? next[expert]++ : -1;
      });
    });
    return true;
  }

  // Whether token_order is a permutation of 0..T-1; the first entry that is
  // not goes to `fault`.
  static bool token_order_is_permutation(const RouteProblem& p, unsigned char* seen, ScanFault& fault) {
    const int64_t T = p.num_tokens;
    std::memset(seen, 0, static_cast<size_t>(T));
    for (int64_t r = 0; r < T; ++r) {
      const int64_t t = p.token_order[r];
      if (t < 0 || t >= T || seen[t]) {
        fault.bad_order_entry = r;
        fault.bad_order_value = t;
        return false;
      }
      seen[t] = 1;
    }
    return true;
  }

  int threads_;
};

}  // namespace

std::unique_ptr<Kernels> make_cpu_kernels(int num_threads) { return std::make_unique<CpuKernels>(num_threads); }

void weighted_sum_cpu(a2a_dtype_t dtype, void* out, const void* const* sources, const void* weights, int64_t count,
                      int64_t n) {
  with_float_type("weighted_sum", dtype, [&](auto tag) {
    using T = decltype(tag);
    const RowKernels<T> kernels(0);
    kernels.weighted_sum(static_cast<T*>(out), reinterpret_cast<const T* const*>(sources),
                         static_cast<const typename Num<T>::Acc*>(weights), count, n);
  });
}

}  // namespace a2a::moe
