// The CUDA kernels of the low-latency dispatch and combine
// (low_latency_cuda.cu), behind the CUDA backend's Kernels overrides
// (moe_cuda.cu); moe/kernels.hpp says what each step does. Everything is
// enqueued on launch.stream without waiting, but the status read.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"
#include "cuda/es_cuda.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

void cuda_low_latency_pack(const EsLaunch& launch, const LowLatencyLayout& l, const void* x, int64_t num_tokens,
                           const void* indices, a2a_dtype_t index_dtype, uint32_t sequence, char* workspace);
void cuda_low_latency_reject(const EsLaunch& launch, const LowLatencyLayout& l, uint32_t kind, uint32_t sequence,
                             char* workspace);
void cuda_low_latency_unpack(const EsLaunch& launch, const LowLatencyLayout& l, uint32_t sequence, char* workspace,
                             void* recv, int64_t* recv_counts);
void cuda_low_latency_return(const EsLaunch& launch, const LowLatencyLayout& l, const void* expert_out,
                             uint32_t sequence, char* workspace);
void cuda_low_latency_combine(const EsLaunch& launch, const LowLatencyLayout& l, int64_t num_tokens, const void* gates,
                              a2a_dtype_t gate_dtype, uint32_t sequence, char* workspace, void* y);
// Waits for the stream (bounded by timeout_s), returns the status record and clears it.
LowLatencyStatus cuda_low_latency_status(const EsLaunch& launch, const LowLatencyLayout& l, const char* workspace,
                                         double timeout_s);

}  // namespace a2a::moe
