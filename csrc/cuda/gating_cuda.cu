// CUDA kernels of the fused top-k gate, with the row logic of moe/gating.hpp
// (the CPU backend's, in the same order, so both give the same bits where the
// device's exp agrees with the host's):
//
// rows:     one thread per token, grid-striding: softmax, the top-k choices
//           and their gates (the gate's rows are short: E is tens to hundreds).
// columns:  one block of kGateLanes threads per expert, grid-striding over the
//           experts: lane l sums the expert's scores over the tokens l,
//           l + kGateLanes, ... (in float64) and counts its first choices;
//           thread 0 adds the lanes in lane order, and stores the share.
// loss:     one thread: GShard's loss from the experts' sums, in expert order.
// backward: one thread per token, grid-striding.
//
// Three launches forward and one backward, none waiting on the host: the
// loss needs every expert's column, and a grid has no barrier.
#include "cuda/gating_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "moe/gating.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

constexpr int kRowThreads = 128;

unsigned grid_for(int64_t items, int64_t per_block, int max_blocks) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks)));
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    top_k_gate_rows_kernel(const a2a_top_k_gate_t g, const T* __restrict__ logits, T* __restrict__ scores,
                           int64_t* __restrict__ indices, T* __restrict__ gates) {
  const int64_t E = g.num_experts, k = g.top_k;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < g.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x)
    top_k_gate_row(logits + t * E, E, k, g.normalize != 0, scores + t * E, indices + t * k, gates + t * k);
}

template <typename T>
__global__ void __launch_bounds__(kGateLanes)
    top_k_gate_columns_kernel(const a2a_top_k_gate_t g, const T* __restrict__ scores,
                              const int64_t* __restrict__ indices, T* __restrict__ share, double* __restrict__ sums,
                              int64_t* __restrict__ firsts) {
  __shared__ double lane_sums[kGateLanes];
  __shared__ int64_t lane_firsts[kGateLanes];
  const int lane = static_cast<int>(threadIdx.x);
  for (int64_t e = blockIdx.x; e < g.num_experts; e += gridDim.x) {
    gate_column_lane(scores, indices, g.num_tokens, g.num_experts, g.top_k, e, lane, &lane_sums[lane],
                     &lane_firsts[lane]);
    __syncthreads();
    if (lane == 0) {
      double total = 0;
      int64_t count = 0;
      for (int l = 0; l < kGateLanes; ++l) {
        total += lane_sums[l];
        count += lane_firsts[l];
      }
      sums[e] = total;
      firsts[e] = count;
      share[e] = gate_share<T>(count, g.num_tokens);
    }
    __syncthreads();  // the lanes' arrays are reused for the next expert
  }
}

template <typename T>
__global__ void __launch_bounds__(1)
    top_k_gate_loss_kernel(const a2a_top_k_gate_t g, const double* __restrict__ sums,
                           const int64_t* __restrict__ firsts, T* __restrict__ l_aux) {
  *l_aux = from_double<T>(gshard_loss_of_columns(sums, firsts, g.num_tokens, g.num_experts));
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    top_k_gate_backward_kernel(const a2a_top_k_gate_t g, const T* __restrict__ scores,
                               const int64_t* __restrict__ indices, const T* __restrict__ share,
                               const T* __restrict__ d_gates, const T* __restrict__ d_l_aux, T* __restrict__ d_logits) {
  const int64_t E = g.num_experts, k = g.top_k;
  const auto loss_scale = gate_loss_scale(d_l_aux, E, g.num_tokens);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < g.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x)
    top_k_gate_backward_row(scores + t * E, indices + t * k, d_gates == nullptr ? nullptr : d_gates + t * k, share,
                            loss_scale, E, k, g.normalize != 0, d_logits + t * E);  // a bad index: a row of NaN
}

}  // namespace

void cuda_top_k_gate(const EsLaunch& launch, const a2a_top_k_gate_t& gate, const void* logits, void* scores,
                     int64_t* indices, void* gates, void* share, void* l_aux, void* workspace) {
  with_float_type("top_k_gate", gate.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* sums = static_cast<double*>(workspace);
    auto* firsts = reinterpret_cast<int64_t*>(sums + gate.num_experts);
    if (gate.num_tokens > 0) {
      top_k_gate_rows_kernel<T><<<grid_for(gate.num_tokens, kRowThreads, launch.max_blocks), kRowThreads, 0,
                                  launch.stream>>>(gate, static_cast<const T*>(logits), static_cast<T*>(scores),
                                                   indices, static_cast<T*>(gates));
      check_launch("top_k_gate_rows_kernel");
    }
    top_k_gate_columns_kernel<T><<<grid_for(gate.num_experts, 1, launch.max_blocks), kGateLanes, 0, launch.stream>>>(
        gate, static_cast<const T*>(scores), indices, static_cast<T*>(share), sums, firsts);
    check_launch("top_k_gate_columns_kernel");
    top_k_gate_loss_kernel<T><<<1, 1, 0, launch.stream>>>(gate, sums, firsts, static_cast<T*>(l_aux));
    check_launch("top_k_gate_loss_kernel");
  });
}

void cuda_top_k_gate_backward(const EsLaunch& launch, const a2a_top_k_gate_t& gate, const void* scores,
                              const int64_t* indices, const void* share, const void* d_gates, const void* d_l_aux,
                              void* d_logits) {
  with_float_type("top_k_gate_backward", gate.dtype, [&](auto tag) {
    using T = decltype(tag);
    top_k_gate_backward_kernel<T><<<grid_for(gate.num_tokens, kRowThreads, launch.max_blocks), kRowThreads, 0,
                                    launch.stream>>>(gate, static_cast<const T*>(scores), indices,
                                                     static_cast<const T*>(share), static_cast<const T*>(d_gates),
                                                     static_cast<const T*>(d_l_aux), static_cast<T*>(d_logits));
    check_launch("top_k_gate_backward_kernel");
  });
}

}  // namespace a2a::moe
