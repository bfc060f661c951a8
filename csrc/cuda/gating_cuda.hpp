// The CUDA kernels of the fused top-k gate (gating_cuda.cu), behind the CUDA
// backend's Kernels overrides (moe_cuda.cu). Arguments are already checked
// (moe/gating_ops.cpp); every pointer is device memory; everything is
// enqueued on launch.stream without waiting or allocating, so both can be
// captured into a CUDA graph.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"
#include "cuda/es_cuda.hpp"

namespace a2a::moe {

void cuda_top_k_gate(const EsLaunch& launch, const a2a_top_k_gate_t& gate, const void* logits, void* scores,
                     int64_t* indices, void* gates, void* share, void* l_aux, void* workspace);
void cuda_top_k_gate_backward(const EsLaunch& launch, const a2a_top_k_gate_t& gate, const void* scores,
                              const int64_t* indices, const void* share, const void* d_gates, const void* d_l_aux,
                              void* d_logits);

}  // namespace a2a::moe
