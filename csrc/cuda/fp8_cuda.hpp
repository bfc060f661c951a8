// The CUDA kernels of the FP8 row quantization (fp8_cuda.cu), behind the CUDA
// backend's Kernels overrides (moe_cuda.cu). Arguments are already checked
// (moe/fp8_ops.cpp); every pointer is device memory; everything is enqueued
// on launch.stream without waiting or allocating, so both can be captured
// into a CUDA graph.
#pragma once

#include "a2a/a2a.h"
#include "cuda/es_cuda.hpp"

namespace a2a::moe {

void cuda_quantize_fp8(const EsLaunch& launch, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows);
void cuda_dequantize_fp8(const EsLaunch& launch, const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y);

}  // namespace a2a::moe
