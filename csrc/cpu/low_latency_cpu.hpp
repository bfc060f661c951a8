// CPU backend of the low-latency dispatch and combine's kernels; the Kernels
// overrides of cpu/moe_cpu.cpp call these (moe/kernels.hpp says what each does).
#pragma once

#include <cstdint>

#include "moe/kernels.hpp"

namespace a2a::moe {

void low_latency_pack_cpu(const LowLatencyLayout& l, const void* x, int64_t num_tokens, const void* indices,
                          a2a_dtype_t index_dtype, uint32_t sequence, char* workspace, int64_t* sent);
void low_latency_reject_cpu(const LowLatencyLayout& l, uint32_t kind, uint32_t sequence, char* workspace);
void low_latency_unpack_cpu(const LowLatencyLayout& l, uint32_t sequence, char* workspace, void* recv,
                            int64_t* recv_counts, int64_t* received);
void low_latency_return_cpu(const LowLatencyLayout& l, const void* expert_out, uint32_t sequence, char* workspace);
// out (n elements of dtype) = sum over s < count, in order from 0, of
// weights[s] * sources[s] (weights of the accumulator type: float, double for
// float64): combine's row loop of cpu/moe_cpu.cpp (AVX2 where the CPU has it).
void weighted_sum_cpu(a2a_dtype_t dtype, void* out, const void* const* sources, const void* weights, int64_t count,
                      int64_t n);

void low_latency_combine_cpu(const LowLatencyLayout& l, int64_t num_tokens, const void* gates, a2a_dtype_t gate_dtype,
                             uint32_t sequence, char* workspace, void* y, const int64_t* sent);

}  // namespace a2a::moe
