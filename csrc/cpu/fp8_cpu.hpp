// CPU backend of the FP8 row quantization; the Kernels overrides of
// cpu/moe_cpu.cpp call these. See a2a_quantize_fp8 / a2a_dequantize_fp8 in
// a2a.h for what they compute, moe/fp8.hpp for the element logic.
#pragma once

#include "a2a/a2a.h"

namespace a2a::moe {

void quantize_fp8_cpu(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows, int threads);
void dequantize_fp8_cpu(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y, int threads);

}  // namespace a2a::moe
