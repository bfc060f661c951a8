#include "core/counters.hpp"
#include "moe/fp8_ops.hpp"

#include <tuple>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/arguments.hpp"
#include "moe/fp8.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

const char* format_name(a2a_fp8_format_t format) { return format == A2A_FP8_E5M2 ? "e5m2" : "e4m3"; }

void check_geometry(const char* op, int64_t cols, int64_t block) {
  require(cols >= 0, op, ": cols is ", cols);
  require(block >= 1, op, ": block is ", block, "; it must be >= 1 (channels per scale)");
  checked_product(op, round_up_16(cols) + 16, 4, "packed row bytes");  // keeps every row's byte count in int64
}

// The bytes one strided array spans: rows - 1 strides and one row.
size_t span_bytes(const char* op, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
  if (rows == 0 || row_bytes == 0) return 0;
  return static_cast<size_t>(checked_product(op, rows - 1, stride_bytes, "rows * stride") + row_bytes);
}

// The rows' shape and strides, and the memory they take: the codes and the
// scales may interleave (packed rows) but no byte may be in both, nor in
// the dense operand (x or y).
void check_rows(const char* op, const a2a_fp8_rows_t* rows, a2a_dtype_t dtype, const char* dense_name,
                const void* dense, bool rows_written) {
  require(rows != nullptr, op, ": rows is NULL");
  const a2a_fp8_rows_t& r = *rows;
  require(r.rows >= 0, op, ": rows.rows is ", r.rows);
  check_geometry(op, r.cols, r.block);
  require(r.format == A2A_FP8_E4M3 || r.format == A2A_FP8_E5M2, op, ": format is ", static_cast<int>(r.format),
          "; expected A2A_FP8_E4M3 (0) or A2A_FP8_E5M2 (1)");
  require(is_float(dtype), op, ": dtype ", dtype_name(dtype), " is not supported (float32, float64, float16, bfloat16)");
  const int64_t blocks = fp8_blocks(r.cols, r.block);
  require(r.q_stride >= r.cols, op, ": q_stride ", r.q_stride, " is less than cols ", r.cols,
          " (bytes from one row's codes to the next)");
  require(r.scale_stride >= blocks, op, ": scale_stride ", r.scale_stride, " is less than the ", blocks,
          " blocks of a row (cols ", r.cols, ", block ", r.block, ")");
  require(reinterpret_cast<uintptr_t>(r.scales) % alignof(float) == 0, op, ": scales are not 4-byte aligned");
  const size_t q_span = span_bytes(op, r.rows, r.q_stride, r.cols);
  const size_t scale_span =
      span_bytes(op, r.rows, checked_product(op, r.scale_stride, 4, "scale_stride * 4"), blocks * 4);
  const size_t dense_bytes = data_bytes(op, r.rows, r.cols, dtype);
  // Codes and scales either lie apart, or interleave as the two parts of
  // rows of one stride, the scales within each row's gap after its codes.
  const char* q = static_cast<const char*>(r.q);
  const char* s = reinterpret_cast<const char*>(r.scales);
  const bool apart = q_span == 0 || scale_span == 0 || q + q_span <= s || s + scale_span <= q;
  const int64_t gap = s - q;
  const bool interleaved = r.q_stride == r.scale_stride * 4 && gap >= r.cols && gap + blocks * 4 <= r.q_stride;
  require(apart || interleaved, op, ": the codes (", q_span, " bytes) and the scales (", scale_span,
          " bytes) overlap; give them memory of their own, or the layout of a2a_fp8_packed_layout");
  require(dense_bytes == 0 || dense != nullptr, op, ": ", dense_name, " is NULL");
  require(q_span == 0 || r.q != nullptr, op, ": q is NULL");
  require(scale_span == 0 || r.scales != nullptr, op, ": scales are NULL");
  // The dense operand against each strided array, by their spans.
  const char* d = static_cast<const char*>(dense);
  for (const auto& [name, begin, bytes] : {std::tuple<const char*, const char*, size_t>{"q", q, q_span},
                                           {"scales", s, scale_span}}) {
    const bool overlap = dense_bytes != 0 && bytes != 0 && d < begin + bytes && begin < d + dense_bytes;
    require(!overlap, op, ": ", dense_name, " (", dense_bytes, " bytes) overlaps ", name, " (", bytes, " bytes, ",
            format_name(r.format), rows_written ? " output" : " input",
            "); the kernels do not work in place: give every output memory of its own");
  }
}

}  // namespace

Fp8Packed fp8_packed_layout(int64_t cols, int64_t block) {
  check_geometry("fp8_packed_layout", cols, block);
  const int64_t scale_offset = round_up_16(cols);
  return Fp8Packed{scale_offset, scale_offset + round_up_16(fp8_blocks(cols, block) * 4)};
}

void quantize_fp8(const a2a_exec_t* exec, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t* out) {
  check_rows("quantize_fp8", out, dtype, "x", x, true);
  if (out->rows > 0 && out->cols > 0) {
    count(nullptr, Count::kKernelCalls);
    make_kernels(exec)->quantize_fp8(x, dtype, *out);
  }
}

void dequantize_fp8(const a2a_exec_t* exec, const a2a_fp8_rows_t* in, a2a_dtype_t dtype, void* y) {
  check_rows("dequantize_fp8", in, dtype, "y", y, false);
  if (in->rows > 0 && in->cols > 0) {
    count(nullptr, Count::kKernelCalls);
    make_kernels(exec)->dequantize_fp8(*in, dtype, y);
  }
}

}  // namespace a2a::moe
