#include "core/elementwise_reduce.hpp"

#include <cstdint>

#include "core/error.hpp"
#include "core/half.hpp"

namespace a2a {

namespace {

template <typename T>
T combine(T x, T y, ReduceOp op) {
  if (op == ReduceOp::kSum) return static_cast<T>(x + y);
  if (x != x || y != y) return x + y;  // NaN in, NaN out (floating types only: integers equal themselves)
  return op == ReduceOp::kMax ? (x > y ? x : y) : (x < y ? x : y);
}

template <typename T>
void reduce_typed(void* inout, const void* in, size_t count, ReduceOp op) {
  auto* b = static_cast<T*>(inout);
  const auto* a = static_cast<const T*>(in);
  for (size_t i = 0; i < count; ++i) b[i] = combine(b[i], a[i], op);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void reduce_16bit(void* inout, const void* in, size_t count, ReduceOp op) {
  auto* b = static_cast<uint16_t*>(inout);
  const auto* a = static_cast<const uint16_t*>(in);
  for (size_t i = 0; i < count; ++i) b[i] = FromFloat(combine(ToFloat(b[i]), ToFloat(a[i]), op));
}

float half_in(uint16_t h) { return half_to_float(h); }
uint16_t half_out(float f) { return float_to_half(f); }
float bf16_in(uint16_t b) { return bfloat16_to_float(b); }
uint16_t bf16_out(float f) { return float_to_bfloat16(f); }

}  // namespace

void reduce_into(void* inout, const void* in, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  switch (dtype) {
    case A2A_FLOAT32: return reduce_typed<float>(inout, in, count, op);
    case A2A_FLOAT64: return reduce_typed<double>(inout, in, count, op);
    case A2A_INT8: return reduce_typed<int8_t>(inout, in, count, op);
    case A2A_INT32: return reduce_typed<int32_t>(inout, in, count, op);
    case A2A_INT64: return reduce_typed<int64_t>(inout, in, count, op);
    case A2A_UINT8: return reduce_typed<uint8_t>(inout, in, count, op);
    case A2A_FLOAT16: return reduce_16bit<half_in, half_out>(inout, in, count, op);
    case A2A_BFLOAT16: return reduce_16bit<bf16_in, bf16_out>(inout, in, count, op);
  }
  fail(A2A_ERROR_INTERNAL, "reduce_into: dtype code ", static_cast<int>(dtype));
}

}  // namespace a2a
