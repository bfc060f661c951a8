#include "core/counters.hpp"
#include "moe/es_ops.hpp"

#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/arguments.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

constexpr size_t kAlign = 256;  // the workspace's locations start on a fresh line (and CUDA alignment)

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

bool is_rows(a2a_es_rows_t rows) { return rows == A2A_ES_ROWS_TOKEN || rows == A2A_ES_ROWS_CHOICE; }

const char* rows_name(a2a_es_rows_t rows) { return rows == A2A_ES_ROWS_TOKEN ? "token" : "choice"; }

// Rows of an operand addressed by `rows`: T by token, T * k by choice.
int64_t operand_rows(const a2a_es_index_t& index, a2a_es_rows_t rows) {
  return rows == A2A_ES_ROWS_TOKEN ? index.num_tokens : index.num_tokens * index.top_k;
}

// The index itself: shape, tile, and a layout a2a_es_index could have made
// (the kernels trust the slots' values, as the dispatch kernels trust a routing).
void check_index(const char* op, const a2a_es_index_t* index) {
  require(index != nullptr, op, ": index is NULL");
  const a2a_es_index_t& r = *index;
  check_shape(op, r.num_tokens, r.top_k, r.num_experts);
  require(r.tile >= 1, op, ": index tile is ", r.tile, "; it must be >= 1");
  require(r.num_slots >= 0, op, ": index num_slots is ", r.num_slots);
  const int64_t padding = checked_product(op, r.num_experts, r.tile - 1, "num_experts * tile");
  require(r.num_slots <= r.num_tokens * r.top_k + padding, op,
          ": index num_slots ", r.num_slots, " is more than ", r.num_tokens, " tokens x ", r.top_k,
          " choices can fill with ", r.num_experts, " experts padded to ", r.tile, "; build the index with a2a_es_index");
}

void check_data(const char* op, a2a_dtype_t dtype, bool has_gates, a2a_dtype_t gate_dtype) {
  require(is_float(dtype), op, ": data dtype ", dtype_name(dtype),
          " is not supported (float32, float64, float16, bfloat16)");
  if (has_gates)
    require(gate_dtype == A2A_FLOAT32 || gate_dtype == dtype, op, ": gate dtype ", dtype_name(gate_dtype),
            " must be float32 or the data dtype ", dtype_name(dtype));
}

void check_operand(const char* op, const char* name, a2a_es_rows_t rows, int64_t dim) {
  require(is_rows(rows), op, ": ", name, "_rows is ", static_cast<int>(rows),
          "; expected A2A_ES_ROWS_TOKEN (0) or A2A_ES_ROWS_CHOICE (1)");
  require(dim >= 0, op, ": ", name, " width is ", dim);
}

// The index's arrays (inputs) in a call's buffer list.
Buffers& index_buffers(Buffers& buffers, const a2a_es_index_t& r) {
  const size_t experts = static_cast<size_t>(r.num_experts);
  return buffers.input("index.slots", r.slots, static_cast<size_t>(r.num_slots) * sizeof(int64_t))
      .input("index.expert_starts", r.expert_starts, (experts + 1) * sizeof(int64_t))
      .input("index.counts", r.counts, experts * sizeof(int64_t));
}

size_t gate_bytes(const a2a_es_index_t& r, const void* gates, a2a_dtype_t gate_dtype) {
  return gates == nullptr ? 0 : static_cast<size_t>(r.num_tokens * r.top_k) * dtype_size(gate_dtype);
}

size_t accumulator_size(a2a_dtype_t dtype) { return dtype == A2A_FLOAT64 ? sizeof(double) : sizeof(float); }

}  // namespace

int64_t es_index_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile) {
  check_shape("es_index", num_tokens, top_k, num_experts);
  require(tile >= 1, "es_index: tile is ", tile, "; it must be >= 1");
  const int64_t padding = checked_product("es_index", num_experts, tile - 1, "num_experts * (tile - 1)");
  int64_t total = 0;
  if (__builtin_add_overflow(num_tokens * top_k, padding, &total))
    fail(A2A_ERROR_INVALID_ARGUMENT, "es_index: num_tokens * top_k + num_experts * (tile - 1) overflows int64");
  return total;
}

size_t es_index_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  check_shape("es_index", num_tokens, top_k, num_experts);
  // The location scan's own workspace, then the (T, k) locations it writes.
  return aligned(make_kernels(exec)->locate_workspace_size(num_tokens, top_k, num_experts)) +
         static_cast<size_t>(num_tokens * top_k) * sizeof(int64_t);
}

int64_t es_index(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                 int64_t top_k, int64_t num_experts, int64_t tile, void* workspace, size_t workspace_bytes,
                 int64_t* slots, int64_t max_slots, int64_t* expert_starts, int64_t* counts) {
  const char* op = "es_index";
  es_index_capacity(num_tokens, top_k, num_experts, tile);  // checks the shape and the tile
  require(is_index(index_dtype), op, ": indices dtype ", dtype_name(index_dtype), " is not int32 or int64");
  require(max_slots >= 0, op, ": max_slots is ", max_slots);
  auto kernels = make_kernels(exec);
  const size_t scan_bytes = aligned(kernels->locate_workspace_size(num_tokens, top_k, num_experts));
  const size_t choices = static_cast<size_t>(num_tokens * top_k), experts = static_cast<size_t>(num_experts);
  const size_t needed = scan_bytes + choices * sizeof(int64_t);
  require(workspace_bytes >= needed, op, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
          " bytes required (a2a_es_index_workspace_size)");
  Buffers(op)
      .input("indices", indices, choices * dtype_size(index_dtype))
      .output("workspace", workspace, needed)
      .output("slots", slots, static_cast<size_t>(max_slots) * sizeof(int64_t))
      .output("expert_starts", expert_starts, (experts + 1) * sizeof(int64_t))
      .output("counts", counts, experts * sizeof(int64_t));
  int64_t* locations = reinterpret_cast<int64_t*>(static_cast<char*>(workspace) + scan_bytes);
  const RouteProblem problem{indices, index_dtype, num_tokens, top_k, num_experts, nullptr};
  std::vector<int64_t> demand;
  try {
    count(nullptr, Count::kKernelCalls);
    count(nullptr, Count::kHostWaits);  // the demand comes back to the host
    kernels->locate(problem, workspace, scan_bytes, locations, demand);
  } catch (const Failure& failure) {
    // The scan words its errors as route's; this call is es_index.
    std::string message = failure.what();
    if (message.compare(0, 7, "route: ") == 0) message.replace(0, 5, op);
    throw Failure(failure.status(), message);
  }
  std::vector<int64_t> starts(experts + 1, 0);
  for (size_t e = 0; e < experts; ++e) starts[e + 1] = starts[e] + (demand[e] + tile - 1) / tile * tile;
  const int64_t num_slots = starts[experts];
  require(num_slots <= max_slots, op, ": the re-index vector needs ", num_slots, " slots but slots holds ",
          max_slots, " (allocate a2a_es_index_capacity)");
  count(nullptr, Count::kKernelCalls, 3);
  kernels->upload(expert_starts, starts.data(), starts.size() * sizeof(int64_t));
  kernels->upload(counts, demand.data(), demand.size() * sizeof(int64_t));
  kernels->es_scatter_slots(problem, locations, expert_starts, num_slots, slots);
  return num_slots;
}

size_t esmm_workspace_size(const a2a_es_index_t* index, a2a_es_rows_t y_rows, int64_t n, a2a_dtype_t dtype) {
  check_index("esmm", index);
  check_operand("esmm", "y", y_rows, n);
  check_data("esmm", dtype, false, dtype);
  if (y_rows != A2A_ES_ROWS_TOKEN || index->top_k == 1) return 0;
  const int64_t elements = checked_product("esmm", index->num_tokens * index->top_k, n, "T * k * n");
  return static_cast<size_t>(
      checked_product("esmm", elements, static_cast<int64_t>(accumulator_size(dtype)), "esmm workspace bytes"));
}

void esmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows, int64_t k,
          const void* w, a2a_es_weight_layout_t w_layout, const void* bias, const void* gates, a2a_dtype_t gate_dtype,
          a2a_dtype_t dtype, int64_t n, void* y, a2a_es_rows_t y_rows, void* workspace, size_t workspace_bytes) {
  const char* op = "esmm";
  check_index(op, index);
  check_operand(op, "x", x_rows, k);
  check_data(op, dtype, gates != nullptr, gate_dtype);
  require(w_layout == A2A_ES_WEIGHT_NK || w_layout == A2A_ES_WEIGHT_KN, op, ": w_layout is ",
          static_cast<int>(w_layout), "; expected A2A_ES_WEIGHT_NK (0) or A2A_ES_WEIGHT_KN (1)");
  const size_t needed = esmm_workspace_size(index, y_rows, n, dtype);
  require(workspace_bytes >= needed, op, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
          " bytes required (a2a_esmm_workspace_size)");
  const a2a_es_index_t& r = *index;
  const int64_t weights = checked_product(op, checked_product(op, r.num_experts, n, "E * n"), k, "E * n * k");
  Buffers buffers(op);
  index_buffers(buffers, r)
      .input("x", x, data_bytes(op, operand_rows(r, x_rows), k, dtype))
      .input("w", w, data_bytes(op, weights, 1, dtype))
      .input("bias", bias, bias == nullptr ? 0 : data_bytes(op, r.num_experts, n, dtype))
      .input("gates", gates, gate_bytes(r, gates, gate_dtype))
      .output("y", y, data_bytes(op, operand_rows(r, y_rows), n, dtype))
      .output("workspace", workspace, needed);
  if (n == 0 || operand_rows(r, y_rows) == 0) return;
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->esmm(r, EsMatmul{{x, x_rows, k}, w, w_layout, bias, {gates, gate_dtype == dtype}, dtype, n, y,
                                       y_rows, needed ? workspace : nullptr});
}

void ess(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows, const void* gates,
         a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* out) {
  const char* op = "ess";
  check_index(op, index);
  check_operand(op, "x", x_rows, n);
  check_data(op, dtype, gates != nullptr, gate_dtype);
  const a2a_es_index_t& r = *index;
  Buffers buffers(op);
  index_buffers(buffers, r)
      .input("x", x, data_bytes(op, operand_rows(r, x_rows), n, dtype))
      .input("gates", gates, gate_bytes(r, gates, gate_dtype))
      .output("out", out, data_bytes(op, r.num_experts, n, dtype));
  if (n == 0) return;
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->ess(r, {x, x_rows, n}, {gates, gate_dtype == dtype}, dtype, out);
}

void estmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* a, a2a_es_rows_t a_rows, int64_t a_dim,
           const void* b, a2a_es_rows_t b_rows, int64_t b_dim, const void* gates, a2a_dtype_t gate_dtype,
           a2a_dtype_t dtype, void* out) {
  const char* op = "estmm";
  check_index(op, index);
  check_operand(op, "a", a_rows, a_dim);
  check_operand(op, "b", b_rows, b_dim);
  check_data(op, dtype, gates != nullptr, gate_dtype);
  const a2a_es_index_t& r = *index;
  const int64_t outputs =
      checked_product(op, checked_product(op, r.num_experts, a_dim, "E * a_dim"), b_dim, "E * a * b");
  Buffers buffers(op);
  index_buffers(buffers, r)
      .input("a", a, data_bytes(op, operand_rows(r, a_rows), a_dim, dtype))
      .input("b", b, data_bytes(op, operand_rows(r, b_rows), b_dim, dtype))
      .input("gates", gates, gate_bytes(r, gates, gate_dtype))
      .output("out", out, data_bytes(op, outputs, 1, dtype));
  if (outputs == 0) return;
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->estmm(r, {a, a_rows, a_dim}, {b, b_rows, b_dim}, {gates, gate_dtype == dtype}, dtype, out);
}

}  // namespace a2a::moe
