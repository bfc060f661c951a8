// CUDA kernels of the low-latency dispatch and combine (the wire is
// moe/kernels.hpp's; cpu/low_latency_cpu.cpp is the CPU twin, and gives the
// same bytes and bits). Nothing here waits for the stream or allocates: the
// counts stay in the slot headers, on the device, and what the CPU would
// throw goes to the workspace's status record (read by low_latency_status,
// the one call that synchronizes).
//
// pack:    one thread walks the choices in (token, choice) order and hands
//          out each destination's rows (a few hundred at most: sequential is
//          deterministic and short), then a grid copies the rows.
// unpack:  one warp per local expert finds that expert's received rows in
//          (source, row) order with ballots, so positions are the CPU's;
//          then a grid copies the rows.
// return:  a grid copies each received row's output back into the slots.
// combine: one thread per output element sums its token's choices in order,
//          products rounded alone (mul_rn) as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/low_latency_cuda.hpp"
#include "cuda/stream_wait.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/elementwise.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kHeader = sizeof(LowLatencyHeader);

unsigned grid_for(int64_t items, int64_t per_block, int max_blocks) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks)));
}

__device__ __forceinline__ char* slot_at(const LowLatencyLayout& l, char* workspace, size_t region, int64_t peer) {
  return workspace + region + peer * l.slot_bytes;
}

__device__ __forceinline__ LowLatencyHeader* header_at(const LowLatencyLayout& l, char* workspace, size_t region,
                                                        int64_t peer) {
  return reinterpret_cast<LowLatencyHeader*>(slot_at(l, workspace, region, peer));
}

__device__ __forceinline__ LowLatencyStatus* status_of(const LowLatencyLayout& l, char* workspace) {
  return reinterpret_cast<LowLatencyStatus*>(workspace + l.status);
}

// Notes the first offender of one kind (value + 1, in uint64 so that no
// index overflows; 0 stays "none").
__device__ __forceinline__ void note(int64_t* entry, int64_t value) {
  atomicCAS(reinterpret_cast<unsigned long long*>(entry), 0ull, static_cast<unsigned long long>(value) + 1ull);
}

// The rows of peer's receive slot that this call may read: its count when
// the header is this call's, else 0 (and the status notes why).
__device__ int64_t checked_count(const LowLatencyLayout& l, char* workspace, int64_t peer, uint32_t kind,
                                 uint32_t sequence, bool record) {
  const LowLatencyHeader h = *header_at(l, workspace, l.recv, peer);
  const bool ours = h.kind == kind && h.sequence == sequence && h.source == peer;
  if (ours && h.count == -1) {
    if (record) note(&status_of(l, workspace)->rejected_by, peer);
    return 0;
  }
  if (!ours || h.count < 0 || h.count > l.slot_rows) {
    if (record) note(&status_of(l, workspace)->mismatched_from, peer);
    return 0;
  }
  return h.count;
}

// Copies `bytes` from src to dst with the block's threads (16-byte vectors
// when both are 16-byte aligned and bytes is a multiple of 16).
__device__ void copy_row(char* dst, const char* src, int64_t bytes, int64_t zero_to) {
  const bool vectors = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0;
  if (vectors) {
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
  for (int64_t i = bytes + threadIdx.x; i < zero_to; i += blockDim.x) dst[i] = 0;
}

__global__ void __launch_bounds__(1) pack_index_kernel(const LowLatencyLayout l, int64_t num_tokens,
                                                       const void* __restrict__ indices, a2a_dtype_t index_dtype,
                                                       uint32_t sequence, char* __restrict__ workspace) {
  int64_t* choices = reinterpret_cast<int64_t*>(workspace + l.choices);
  for (int64_t peer = 0; peer < l.world; ++peer) header_at(l, workspace, l.send, peer)->count = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < l.top_k; ++j) {
      const int64_t c = t * l.top_k + j;
      const int64_t expert = load_index(indices, index_dtype, c);
      choices[c] = -1;
      if (expert >= l.num_experts) {
        note(&status_of(l, workspace)->bad_choice, c);
        note(&status_of(l, workspace)->bad_value, expert);
        continue;
      }
      if (expert < 0) continue;
      const int64_t earlier = earlier_same_expert(indices, index_dtype, t, j, l.top_k, expert);
      if (earlier >= 0) {
        choices[c] = choices[earlier];
        continue;
      }
      const int64_t peer = expert / l.local_experts;
      LowLatencyHeader* h = header_at(l, workspace, l.send, peer);
      const int64_t row = h->count++;
      int32_t* meta = reinterpret_cast<int32_t*>(slot_at(l, workspace, l.send, peer) + kHeader +
                                                 row * l.dispatch_row + l.dispatch_row - 16);
      meta[0] = static_cast<int32_t>(t);
      meta[1] = static_cast<int32_t>(expert % l.local_experts);
      meta[2] = meta[3] = 0;
      choices[c] = (peer << 32) | row;
    }
  }
  for (int64_t peer = 0; peer < l.world; ++peer) {
    LowLatencyHeader* h = header_at(l, workspace, l.send, peer);
    h->kind = kLowLatencyDispatch;
    h->sequence = sequence;
    h->source = l.rank;
  }
}

// One block per choice (grid-stride): the row of a choice that opened one.
__global__ void __launch_bounds__(kThreads) pack_rows_kernel(const LowLatencyLayout l, int64_t num_tokens,
                                                              const char* __restrict__ x, char* __restrict__ workspace) {
  const int64_t* choices = reinterpret_cast<const int64_t*>(workspace + l.choices);
  for (int64_t c = blockIdx.x; c < num_tokens * l.top_k; c += gridDim.x) {
    const int64_t code = choices[c];
    if (code < 0) continue;
    const int64_t t = c / l.top_k;
    bool first = true;  // the token's earliest choice with this row copies it
    for (int64_t i = t * l.top_k; i < c; ++i) first = first && choices[i] != code;
    if (!first) continue;
    char* row = slot_at(l, workspace, l.send, code >> 32) + kHeader + (code & 0xffffffff) * l.dispatch_row;
    copy_row(row, x + t * l.row_bytes, l.row_bytes, l.dispatch_row - 16);
  }
}

__global__ void __launch_bounds__(kThreads) reject_kernel(const LowLatencyLayout l, uint32_t kind, uint32_t sequence,
                                                           char* __restrict__ workspace) {
  for (int64_t peer = threadIdx.x; peer < l.world; peer += blockDim.x)
    *header_at(l, workspace, l.send, peer) = LowLatencyHeader{kind, sequence, -1, l.rank};
}

// One warp per local expert (grid-stride): its rows in (source, row) order,
// their positions in recv and the arrivals table; lane 0 of expert 0 notes
// the headers' faults.
__global__ void __launch_bounds__(kWarp) unpack_index_kernel(const LowLatencyLayout l, uint32_t sequence,
                                                              char* __restrict__ workspace,
                                                              int64_t* __restrict__ recv_counts) {
  const int lane = threadIdx.x;
  int64_t* arrivals = reinterpret_cast<int64_t*>(workspace + l.arrivals);
  for (int64_t expert = blockIdx.x; expert < l.local_experts; expert += gridDim.x) {
    int64_t position = 0;
    for (int64_t peer = 0; peer < l.world; ++peer) {
      const int64_t count = checked_count(l, workspace, peer, kLowLatencyDispatch, sequence, expert == 0 && lane == 0);
      const char* rows = slot_at(l, workspace, l.recv, peer) + kHeader;
      for (int64_t base = 0; base < count; base += kWarp) {
        const int64_t i = base + lane;
        bool mine = false;
        if (i < count) {
          const int32_t* meta = reinterpret_cast<const int32_t*>(rows + i * l.dispatch_row + l.dispatch_row - 16);
          const bool valid = meta[1] >= 0 && meta[1] < l.local_experts && meta[0] >= 0 && meta[0] < l.max_tokens;
          if (!valid && expert == 0) {  // no expert takes it: the way back must not read an old arrival
            note(&status_of(l, workspace)->mismatched_from, peer);
            arrivals[peer * l.slot_rows + i] = -1;
          }
          mine = valid && meta[1] == expert;
        }
        const unsigned ballot = __ballot_sync(kFullMask, mine);
        if (mine) arrivals[peer * l.slot_rows + i] = expert * l.expert_capacity + position + __popc(ballot & ((1u << lane) - 1u));
        position += __popc(ballot);
      }
    }
    if (lane == 0) recv_counts[expert] = position;
  }
}

// One block per received row (grid-stride over (source, row)).
__global__ void __launch_bounds__(kThreads) unpack_rows_kernel(const LowLatencyLayout l, uint32_t sequence,
                                                                char* __restrict__ workspace, char* __restrict__ recv) {
  const int64_t* arrivals = reinterpret_cast<const int64_t*>(workspace + l.arrivals);
  for (int64_t item = blockIdx.x; item < l.world * l.slot_rows; item += gridDim.x) {
    const int64_t peer = item / l.slot_rows, i = item % l.slot_rows;
    if (i >= checked_count(l, workspace, peer, kLowLatencyDispatch, sequence, false)) continue;
    const char* row = slot_at(l, workspace, l.recv, peer) + kHeader + i * l.dispatch_row;
    const int32_t* meta = reinterpret_cast<const int32_t*>(row + l.dispatch_row - 16);
    if (meta[1] < 0 || meta[1] >= l.local_experts || meta[0] < 0 || meta[0] >= l.max_tokens) continue;
    copy_row(recv + arrivals[item] * l.row_bytes, row, l.row_bytes, l.row_bytes);
  }
}

// One block per row of the way back (grid-stride over (source, row)); the
// headers from block 0.
__global__ void __launch_bounds__(kThreads) return_kernel(const LowLatencyLayout l, const char* __restrict__ expert_out,
                                                           int64_t out_row, uint32_t sequence,
                                                           char* __restrict__ workspace) {
  const int64_t* arrivals = reinterpret_cast<const int64_t*>(workspace + l.arrivals);
  for (int64_t item = blockIdx.x; item < l.world * l.slot_rows; item += gridDim.x) {
    const int64_t peer = item / l.slot_rows, i = item % l.slot_rows;
    if (i >= checked_count(l, workspace, peer, kLowLatencyDispatch, sequence - 1, false)) continue;
    char* row = slot_at(l, workspace, l.send, peer) + kHeader + i * l.combine_row;
    if (arrivals[item] < 0) {  // a row unpack refused (noted there): zeros go back
      for (int64_t b = threadIdx.x; b < l.combine_row; b += blockDim.x) row[b] = 0;
      continue;
    }
    copy_row(row, expert_out + arrivals[item] * out_row, out_row, l.combine_row);
  }
  if (blockIdx.x == 0)
    for (int64_t peer = threadIdx.x; peer < l.world; peer += blockDim.x) {
      const int64_t count = checked_count(l, workspace, peer, kLowLatencyDispatch, sequence - 1, false);
      *header_at(l, workspace, l.send, peer) =
          LowLatencyHeader{kLowLatencyCombine, sequence, static_cast<int32_t>(count), l.rank};
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const LowLatencyLayout l, int64_t num_tokens,
                                                            const void* __restrict__ gates, bool gate_is_data,
                                                            uint32_t sequence, char* __restrict__ workspace,
                                                            T* __restrict__ y) {
  using Acc = typename Num<T>::Acc;
  const int64_t* choices = reinterpret_cast<const int64_t*>(workspace + l.choices);
  const int64_t elements = num_tokens * l.model_dim;
  const bool record = blockIdx.x == 0 && threadIdx.x == 0;
  if (record)
    for (int64_t peer = 0; peer < l.world; ++peer)
      checked_count(l, workspace, peer, kLowLatencyCombine, sequence, true);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < elements;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / l.model_dim, m = e % l.model_dim;
    Acc sum = Acc(0);
    for (int64_t j = 0; j < l.top_k; ++j) {
      const int64_t c = t * l.top_k + j;
      const int64_t code = choices[c];
      if (code < 0) continue;
      const int64_t peer = code >> 32, row = code & 0xffffffff;
      if (row >= checked_count(l, workspace, peer, kLowLatencyCombine, sequence, false)) continue;
      const T* values = reinterpret_cast<const T*>(slot_at(l, workspace, l.recv, peer) + kHeader + row * l.combine_row);
      sum = sum + mul_rn(load_gate<T>(gates, gate_is_data, c), Num<T>::load(values[m]));
    }
    y[e] = Num<T>::store(sum);
  }
}

}  // namespace

void cuda_low_latency_pack(const EsLaunch& launch, const LowLatencyLayout& l, const void* x, int64_t num_tokens,
                           const void* indices, a2a_dtype_t index_dtype, uint32_t sequence, char* workspace) {
  pack_index_kernel<<<1, 1, 0, launch.stream>>>(l, num_tokens, indices, index_dtype, sequence, workspace);
  check_launch("pack_index_kernel");
  if (num_tokens == 0) return;
  pack_rows_kernel<<<grid_for(num_tokens * l.top_k, 1, launch.max_blocks), kThreads, 0, launch.stream>>>(
      l, num_tokens, static_cast<const char*>(x), workspace);
  check_launch("pack_rows_kernel");
}

void cuda_low_latency_reject(const EsLaunch& launch, const LowLatencyLayout& l, uint32_t kind, uint32_t sequence,
                             char* workspace) {
  reject_kernel<<<1, kThreads, 0, launch.stream>>>(l, kind, sequence, workspace);
  check_launch("reject_kernel");
}

void cuda_low_latency_unpack(const EsLaunch& launch, const LowLatencyLayout& l, uint32_t sequence, char* workspace,
                             void* recv, int64_t* recv_counts) {
  unpack_index_kernel<<<grid_for(l.local_experts, 1, launch.max_blocks), kWarp, 0, launch.stream>>>(
      l, sequence, workspace, recv_counts);
  check_launch("unpack_index_kernel");
  unpack_rows_kernel<<<grid_for(l.world * l.slot_rows, 1, launch.max_blocks), kThreads, 0, launch.stream>>>(
      l, sequence, workspace, static_cast<char*>(recv));
  check_launch("unpack_rows_kernel");
}

void cuda_low_latency_return(const EsLaunch& launch, const LowLatencyLayout& l, const void* expert_out,
                             uint32_t sequence, char* workspace) {
  const int64_t out_row = l.model_dim * static_cast<int64_t>(dtype_size(l.dtype));
  return_kernel<<<grid_for(l.world * l.slot_rows, 1, launch.max_blocks), kThreads, 0, launch.stream>>>(
      l, static_cast<const char*>(expert_out), out_row, sequence, workspace);
  check_launch("return_kernel");
}

void cuda_low_latency_combine(const EsLaunch& launch, const LowLatencyLayout& l, int64_t num_tokens, const void* gates,
                              a2a_dtype_t gate_dtype, uint32_t sequence, char* workspace, void* y) {
  with_float_type("low_latency_combine", l.dtype, [&](auto tag) {
    using T = decltype(tag);
    combine_kernel<T><<<grid_for(num_tokens * l.model_dim, kThreads, launch.max_blocks), kThreads, 0,
                        launch.stream>>>(l, num_tokens, gates, gates != nullptr && gate_dtype == l.dtype, sequence,
                                         workspace, static_cast<T*>(y));
    check_launch("combine_kernel");
  });
}

LowLatencyStatus cuda_low_latency_status(const EsLaunch& launch, const LowLatencyLayout& l, const char* workspace,
                                         double timeout_s) {
  // Wait first, bounded: a copy to pageable memory would block behind a stuck stream.
  if (!wait_for_stream(launch.stream, timeout_s))
    fail(A2A_ERROR_TIMEOUT, "low_latency_check: the CUDA stream did not finish within ", timeout_s,
         " s (A2A_TIMEOUT_S); a low-latency call (or work before it) waits for a peer that never came");
  LowLatencyStatus status{};
  check_cuda(cudaMemcpyAsync(&status, workspace + l.status, sizeof status, cudaMemcpyDeviceToHost, launch.stream),
             "cudaMemcpyAsync (the low-latency status)");
  if (!wait_for_stream(launch.stream, timeout_s))  // the copy alone, on an idle stream
    fail(A2A_ERROR_TIMEOUT, "low_latency_check: the copy of the status did not finish within ", timeout_s, " s");
  // Read: clear it for the calls that follow.
  check_cuda(cudaMemsetAsync(const_cast<char*>(workspace) + l.status, 0, sizeof status, launch.stream),
             "cudaMemsetAsync (the low-latency status)");
  return status;
}

}  // namespace a2a::moe
