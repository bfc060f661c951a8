// Validated entry points of the FP8 row quantization (a2a_fp8_packed_layout,
// a2a_quantize_fp8, a2a_dequantize_fp8): argument checks, then the backend
// (moe/kernels.hpp). The element logic is moe/fp8.hpp's.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"

namespace a2a::moe {

struct Fp8Packed {
  int64_t scale_offset;
  int64_t row_bytes;
};
Fp8Packed fp8_packed_layout(int64_t cols, int64_t block);

void quantize_fp8(const a2a_exec_t* exec, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t* out);
void dequantize_fp8(const a2a_exec_t* exec, const a2a_fp8_rows_t* in, a2a_dtype_t dtype, void* y);

}  // namespace a2a::moe
