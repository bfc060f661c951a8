// The CUDA kernels of the expert-specific operators (es_cuda.cu), behind the
// CUDA backend's Kernels overrides (moe_cuda.cu). Arguments are already
// checked (moe/es_ops.cpp); every pointer is device memory; everything is
// enqueued on launch.stream without waiting or allocating.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "a2a/a2a.h"
#include "moe/kernels.hpp"

namespace a2a::moe {

// Where and how wide to launch: the backend's stream and its grid cap for
// grid-stride kernels.
struct EsLaunch {
  cudaStream_t stream;
  int max_blocks;
};

void cuda_es_scatter_slots(const EsLaunch& launch, const RouteProblem& problem, const int64_t* locations,
                           const int64_t* expert_starts, int64_t num_slots, int64_t* slots);
void cuda_esmm(const EsLaunch& launch, const a2a_es_index_t& index, const EsMatmul& problem);
void cuda_ess(const EsLaunch& launch, const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates,
              a2a_dtype_t dtype, void* out);
void cuda_estmm(const EsLaunch& launch, const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b,
                const EsGates& gates, a2a_dtype_t dtype, void* out);

}  // namespace a2a::moe
