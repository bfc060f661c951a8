#include "moe/arguments.hpp"

#include <algorithm>

#include "core/dtype.hpp"
#include "setup/exec.hpp"
#include "setup/settings.hpp"

namespace a2a::moe {

std::unique_ptr<Kernels> make_kernels(const a2a_exec_t* exec) {
  const a2a_exec_t e = read_exec(exec);
  // route's waits for the stream are bounded by A2A_TIMEOUT_S (else 300 s):
  // the stream is the caller's, not a communicator's.
  if (e.device_type == A2A_DEVICE_CUDA) return make_cuda_kernels(e.stream, timeout_from(A2A_COMM_CONFIG_INIT));
  return make_cpu_kernels(e.num_threads);
}

bool is_float(a2a_dtype_t dtype) {
  return dtype == A2A_FLOAT32 || dtype == A2A_FLOAT64 || dtype == A2A_FLOAT16 || dtype == A2A_BFLOAT16;
}

bool is_index(a2a_dtype_t dtype) { return dtype == A2A_INT32 || dtype == A2A_INT64; }

int64_t checked_product(const char* op, int64_t a, int64_t b, const char* what) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product))
    fail(A2A_ERROR_INVALID_ARGUMENT, op, ": ", what, " overflows int64 (", a, " * ", b, ")");
  return product;
}

void check_shape(const char* op, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  if (num_tokens < 0) fail(A2A_ERROR_INVALID_ARGUMENT, op, ": num_tokens is ", num_tokens);
  if (top_k < 1) fail(A2A_ERROR_INVALID_ARGUMENT, op, ": top_k is ", top_k, "; every token needs at least one choice");
  if (num_experts < 1) fail(A2A_ERROR_INVALID_ARGUMENT, op, ": num_experts is ", num_experts);
  const int64_t choices = checked_product(op, num_tokens, top_k, "num_tokens * top_k");
  // The backends size per-thread (CPU) or per-tile (CUDA) histograms of
  // num_experts int64 counters, at most one per choice: this bound keeps
  // their byte counts from overflowing.
  constexpr int64_t kMaxCounters = int64_t{1} << 58;
  if (num_experts > kMaxCounters / std::max<int64_t>(choices, 1))
    fail(A2A_ERROR_INVALID_ARGUMENT, op, ": num_experts ", num_experts, " with ", choices,
         " routed choices is too large (num_experts * max(1, num_tokens * top_k) must stay below 2^58)");
}

size_t checked_bytes(const char* op, int64_t a, int64_t b, size_t element) {
  return static_cast<size_t>(
      checked_product(op, checked_product(op, a, b, "elements"), static_cast<int64_t>(element), "bytes"));
}

size_t data_bytes(const char* op, int64_t rows, int64_t model_dim, a2a_dtype_t dtype) {
  return checked_bytes(op, rows, model_dim, dtype_size(dtype));
}

}  // namespace a2a::moe
