// Device arithmetic shared by the CUDA MoE kernels (moe_cuda.cu, es_cuda.cu).
#pragma once

#include <cuda_runtime.h>

namespace a2a::moe {

// Products rounded on their own (never fused into an FMA with the sum that
// follows), as on the CPU, so that a sum of scaled terms taken in the same
// order is bitwise the CPU's.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

}  // namespace a2a::moe
