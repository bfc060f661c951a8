#include "core/counters.hpp"
#include "moe/moe.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/arguments.hpp"
#include "moe/kernels.hpp"
#include "setup/exec.hpp"
#include "setup/settings.hpp"

namespace a2a::moe {

namespace {

// Checks a routing and the data arguments of dispatch / combine / gate_grad.
void check_kernel_args(const char* op, const a2a_routing_t* r, a2a_dtype_t dtype, int64_t model_dim,
                       bool has_gates, a2a_dtype_t gate_dtype) {
  require(r != nullptr, op, ": routing is NULL");
  check_shape(op, r->num_tokens, r->top_k, r->num_experts);
  require(is_index(r->index_dtype), op, ": routing index dtype is ", dtype_name(r->index_dtype),
          "; expected int32 or int64");
  require(r->capacity >= A2A_CAPACITY_PER_EXPERT, op, ": routing capacity is ", r->capacity);
  require(r->num_rows >= 0, op, ": routing num_rows is ", r->num_rows);
  if (r->capacity >= 0)
    require(r->num_rows == checked_product(op, r->num_experts, r->capacity, "num_experts * capacity"), op,
            ": routing num_rows ", r->num_rows, " != num_experts ", r->num_experts, " * capacity ", r->capacity);
  require(is_float(dtype), op, ": data dtype ", dtype_name(dtype), " is not supported (float32, float64, float16, bfloat16)");
  require(model_dim >= 0, op, ": model_dim is ", model_dim);
  checked_product(op, std::max(r->num_tokens, r->num_rows), model_dim, "rows * model_dim");
  if (has_gates)
    require(gate_dtype == A2A_FLOAT32 || gate_dtype == dtype, op, ": gate dtype ", dtype_name(gate_dtype),
            " must be float32 or the data dtype ", dtype_name(dtype));
}


// The arguments of dispatch (tokens_in: x (T, M) in, rows (num_rows, M) out)
// and of combine (rows in, y (T, M) out), with the gates.
void check_gated_kernel(const char* op, const a2a_routing_t* routing, a2a_dtype_t dtype, int64_t model_dim,
                        const void* gates, a2a_dtype_t gate_dtype, const char* in_name, const void* in,
                        const char* out_name, void* out, bool tokens_in) {
  check_kernel_args(op, routing, dtype, model_dim, gates != nullptr, gate_dtype);
  const a2a_routing_t& r = *routing;
  const size_t token_bytes = data_bytes(op, r.num_tokens, model_dim, dtype);
  const size_t row_bytes = data_bytes(op, r.num_rows, model_dim, dtype);
  Buffers(op)
      .routing(r)
      .input(in_name, in, tokens_in ? token_bytes : row_bytes)
      .input("gates", gates, gates == nullptr ? 0 : static_cast<size_t>(r.num_tokens * r.top_k) * dtype_size(gate_dtype))
      .output(out_name, out, tokens_in ? row_bytes : token_bytes);
}

}  // namespace

int64_t capacity_from_setting(double setting, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              int64_t max_demand) {
  auto by_factor = [&](double factor) {
    // Same evaluation order as the documented formula ceil(k * x * T / E).
    const double exact = static_cast<double>(top_k) * factor * static_cast<double>(num_tokens) /
                         static_cast<double>(num_experts);
    const double rows = std::ceil(exact);
    if (!(rows < 9.0e15)) fail(A2A_ERROR_INVALID_ARGUMENT, "capacity_setting ", setting, " gives a capacity of ", rows, " rows");
    return static_cast<int64_t>(rows);
  };
  if (setting > 0) return by_factor(setting);
  if (setting == 0) return max_demand;
  return std::min(max_demand, by_factor(-setting));
}

size_t route_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  check_shape("route", num_tokens, top_k, num_experts);
  return make_kernels(exec)->locate_workspace_size(num_tokens, top_k, num_experts);
}

namespace {

// What the caller asked of route: one capacity (or a setting, or
// A2A_CAPACITY_DROPLESS), or one capacity per expert (host, E entries).
struct CapacityRequest {
  bool per_expert;  // a2a_route_capacities
  int64_t capacity;
  double setting;
  const int64_t* capacities;  // host, E entries (per_expert only)
  int64_t* final_capacities;  // host, may be NULL or `capacities`
  int64_t* host_counts;       // host, E entries: a copy of counts
  bool want_host_counts;      // a2a_route_host_counts (host_counts must not be NULL)
};

int64_t checked_sum(const char* op, const std::vector<int64_t>& values, const char* what) {
  int64_t sum = 0;
  for (int64_t value : values)
    if (__builtin_add_overflow(sum, value, &sum)) fail(A2A_ERROR_INVALID_ARGUMENT, op, ": ", what, " overflows int64");
  return sum;
}

// The arrays of a route, checked as the kernels need them: a workspace of at
// least the scan's size, and no two arrays sharing a byte. Returns them, for
// the caller's own arrays.
Buffers route_arrays(const char* op, const Kernels& kernels, const void* indices, a2a_dtype_t index_dtype,
                     int64_t num_tokens, int64_t top_k, int64_t num_experts, const int64_t* token_order,
                     void* workspace, size_t workspace_bytes, int64_t* locations, int64_t* counts,
                     int64_t* expert_offsets) {
  const size_t needed = kernels.locate_workspace_size(num_tokens, top_k, num_experts);
  require(workspace_bytes >= needed, op, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
          " bytes required");
  const size_t choices = static_cast<size_t>(num_tokens * top_k), experts = static_cast<size_t>(num_experts);
  Buffers buffers(op);
  buffers.input("indices", indices, choices * dtype_size(index_dtype))
      .input("token_order", token_order, token_order == nullptr ? 0 : static_cast<size_t>(num_tokens) * sizeof(int64_t))
      .output("workspace", workspace, needed)
      .output("locations", locations, choices * sizeof(int64_t))
      .output("counts", counts, experts * sizeof(int64_t))
      .output("expert_offsets", expert_offsets, (experts + 1) * sizeof(int64_t));
  return buffers;
}

a2a_route_info_t route_with(const a2a_exec_t* exec, Comm* comm, const void* indices, a2a_dtype_t index_dtype,
                            int64_t num_tokens, int64_t top_k, int64_t num_experts, const int64_t* token_order,
                            const CapacityRequest& request, void* workspace, size_t workspace_bytes,
                            int64_t* locations, int64_t* counts, int64_t* expert_offsets) {
  const char* op = "route";
  const bool per_expert = request.per_expert;
  const int64_t capacity = per_expert ? A2A_CAPACITY_PER_EXPERT : request.capacity;
  const double capacity_setting = per_expert ? 0.0 : request.setting;
  const bool dropless = capacity == A2A_CAPACITY_DROPLESS;
  Counters* const counters = comm == nullptr ? nullptr : &comm->counters();  // the process's are counted too
  // The scan below waits for the stream, which may hold a predicted call's
  // work that a peer left: its posted check completes first (Comm::agree).
  if (comm != nullptr) comm->check_posted(op);
  std::unique_ptr<Kernels> kernels;
  std::vector<int64_t> demand;
  // The capacity of every expert: one value, or E values (per-expert).
  std::vector<int64_t> capacities(per_expert ? static_cast<size_t>(std::max<int64_t>(num_experts, 0)) : 1, 0);
  // A local problem is held back until every rank has heard of it (Comm::agree).
  std::exception_ptr local_failure;
  std::string local_error;
  try {
    check_shape(op, num_tokens, top_k, num_experts);
    require(is_index(index_dtype), op, ": indices dtype ", dtype_name(index_dtype), " is not int32 or int64");
    require(capacity >= -1 || per_expert, op, ": capacity ", capacity, " is negative (A2A_CAPACITY_DROPLESS is -1)");
    require(std::isfinite(capacity_setting), op, ": capacity_setting is not finite");
    if (per_expert) {
      require(request.capacities != nullptr, op, ": capacities is NULL");
      for (int64_t e = 0; e < num_experts; ++e) {
        capacities[e] = request.capacities[e];
        require(capacities[e] >= 0, op, ": capacities[", e, "] is ", capacities[e], "; a capacity must be >= 0");
      }
      checked_sum(op, capacities, "the sum of the capacities");
    }
    kernels = make_kernels(exec);
    Buffers buffers = route_arrays(op, *kernels, indices, index_dtype, num_tokens, top_k, num_experts, token_order,
                                   workspace, workspace_bytes, locations, counts, expert_offsets);
    if (request.final_capacities != nullptr)  // host; may be the capacities themselves (read above)
      buffers.output("final_capacities", request.final_capacities,
                     static_cast<size_t>(num_experts) * sizeof(int64_t));
    if (request.want_host_counts) {
      require(request.host_counts != nullptr, op, ": host_counts is NULL");
      buffers.output("host_counts", request.host_counts, static_cast<size_t>(num_experts) * sizeof(int64_t));
    }
    // The demand comes back to the host: on a GPU the host waits for the scan.
    count(counters, Count::kKernelCalls);
    count(counters, Count::kHostWaits);
    kernels->locate({indices, index_dtype, num_tokens, top_k, num_experts, token_order}, workspace, workspace_bytes,
                    locations, demand);
    const int64_t max_demand = *std::max_element(demand.begin(), demand.end());
    if (!per_expert)
      capacities[0] = dropless   ? -1
                      : capacity ? capacity
                                 : capacity_from_setting(capacity_setting, num_tokens, top_k, num_experts, max_demand);
  } catch (const Failure& failure) {
    if (comm == nullptr) throw;
    // Name the rank, as the collectives do, and keep the status.
    std::string message = failure.what();
    const std::string prefix = cat(op, ": ");
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    local_error = cat(op, " on rank ", comm->rank(), " of ", comm->size(), ": ", message);
    local_failure = std::make_exception_ptr(Failure(failure.status(), local_error));
  }
  if (comm != nullptr && !dropless) comm->require_control_outside_capture(op);
  if (comm != nullptr) {
    int64_t setting_bits = 0;
    std::memcpy(&setting_bits, &capacity_setting, sizeof setting_bits);
    const std::vector<Field> fields{{"num_experts", num_experts}, {"top_k", top_k}, {"capacity", capacity},
                                    {"capacity_setting", setting_bits}};
    // Every rank's layout must be the same: each capacity is the maximum over
    // the ranks, gathered in the round of the check (on MPI the gather's
    // labelled messages carry it: one round in all).
    const size_t width = dropless ? 0 : capacities.size();
    std::vector<int64_t> table(width * static_cast<size_t>(comm->size()));
    try {
      if (dropless)
        comm->agree(op, fields, local_error);
      else
        comm->agree_in_exchange(
            op, fields, local_error, comm->control(),
            [&](int) { return Span::contiguous(capacities.data(), width * sizeof(int64_t)); },
            [&](int r) { return Span::contiguous(table.data() + r * width, width * sizeof(int64_t)); });
    } catch (const Failure& failure) {
      if (local_failure) std::rethrow_exception(local_failure);  // keep this rank's own status and message
      throw;
    }
    for (size_t i = 0; i < width; ++i)
      for (int r = 0; r < comm->size(); ++r) capacities[i] = std::max(capacities[i], table[r * width + i]);
  }

  // Counts and offsets of the layout, on the host, then to the device.
  const int64_t E = num_experts;
  if (per_expert)
    checked_sum(op, capacities, "the sum of the capacities agreed across ranks");  // bounds every offset below
  else if (!dropless)
    checked_product(op, E, capacities[0], "num_experts * capacity");
  std::vector<int64_t> kept(static_cast<size_t>(E)), offsets(static_cast<size_t>(E) + 1, 0);
  int64_t num_dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = dropless ? demand[e] : capacities[per_expert ? e : 0];
    kept[e] = std::min(demand[e], rows);
    num_dropped += demand[e] - kept[e];
    offsets[e + 1] = offsets[e] + rows;
  }
  count(counters, Count::kKernelCalls, 2);
  kernels->upload(counts, kept.data(), kept.size() * sizeof(int64_t));
  kernels->upload(expert_offsets, offsets.data(), offsets.size() * sizeof(int64_t));
  if (per_expert && request.final_capacities != nullptr)
    std::copy(capacities.begin(), capacities.end(), request.final_capacities);
  if (request.want_host_counts) std::copy(kept.begin(), kept.end(), request.host_counts);
  return a2a_route_info_t{per_expert ? A2A_CAPACITY_PER_EXPERT : capacities[0], offsets[E], num_dropped};
}

}  // namespace

a2a_route_info_t route(const a2a_exec_t* exec, Comm* comm, const void* indices, a2a_dtype_t index_dtype,
                       int64_t num_tokens, int64_t top_k, int64_t num_experts, const int64_t* token_order,
                       int64_t capacity, double capacity_setting, void* workspace, size_t workspace_bytes,
                       int64_t* locations, int64_t* counts, int64_t* expert_offsets, int64_t* host_counts,
                       bool want_host_counts) {
  return route_with(exec, comm, indices, index_dtype, num_tokens, top_k, num_experts, token_order,
                    {false, capacity, capacity_setting, nullptr, nullptr, host_counts, want_host_counts}, workspace,
                    workspace_bytes, locations, counts, expert_offsets);
}

a2a_route_info_t route_capacities(const a2a_exec_t* exec, Comm* comm, const void* indices, a2a_dtype_t index_dtype,
                                  int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                  const int64_t* token_order, const int64_t* capacities, void* workspace,
                                  size_t workspace_bytes, int64_t* locations, int64_t* counts,
                                  int64_t* expert_offsets, int64_t* final_capacities) {
  return route_with(exec, comm, indices, index_dtype, num_tokens, top_k, num_experts, token_order,
                    {true, A2A_CAPACITY_PER_EXPERT, 0.0, capacities, final_capacities, nullptr, false}, workspace,
                    workspace_bytes, locations, counts, expert_offsets);
}

void route_fixed(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                 int64_t top_k, int64_t num_experts, const int64_t* token_order, int64_t capacity, void* workspace,
                 size_t workspace_bytes, int64_t* locations, int64_t* counts, int64_t* expert_offsets) {
  const char* op = "route_fixed";
  check_shape(op, num_tokens, top_k, num_experts);
  require(is_index(index_dtype), op, ": indices dtype ", dtype_name(index_dtype), " is not int32 or int64");
  require(capacity > 0 || capacity == A2A_CAPACITY_DROPLESS, op, ": capacity ", capacity,
          " must be > 0 or A2A_CAPACITY_DROPLESS (a2a_route takes the other capacity modes)");
  // Bounds every offset (packed: T*k, which check_shape bounds).
  if (capacity > 0) checked_product(op, num_experts, capacity, "num_experts * capacity");
  std::unique_ptr<Kernels> kernels = make_kernels(exec);
  route_arrays(op, *kernels, indices, index_dtype, num_tokens, top_k, num_experts, token_order, workspace,
               workspace_bytes, locations, counts, expert_offsets);
  count(nullptr, Count::kKernelCalls);  // and no host wait: that is route_fixed_dropped's
  kernels->locate_fixed({indices, index_dtype, num_tokens, top_k, num_experts, token_order}, workspace,
                        workspace_bytes, capacity, locations, counts, expert_offsets);
}

int64_t route_fixed_dropped(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                            const void* workspace, size_t workspace_bytes) {
  const char* op = "route_fixed_dropped";
  check_shape(op, num_tokens, top_k, num_experts);
  std::unique_ptr<Kernels> kernels = make_kernels(exec);
  const size_t needed = kernels->locate_workspace_size(num_tokens, top_k, num_experts);
  require(workspace != nullptr, op, ": workspace is NULL");
  require(workspace_bytes >= needed, op, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
          " bytes of a route_fixed of this shape");
  count(nullptr, Count::kHostWaits);  // the result comes back to the host
  const auto [fault, dropped] = kernels->fixed_result(workspace);
  raise_scan_fault(fault, num_tokens, top_k, num_experts);
  return dropped;
}

void dispatch(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* x, a2a_dtype_t dtype,
              int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* rows) {
  if (dtype == A2A_UINT8) {  // rows of opaque bytes (packed FP8 rows)
    require(gates == nullptr, "dispatch: rows of bytes (uint8) take no gates; apply them at the combine");
    require(model_dim % 4 == 0, "dispatch: rows of bytes (uint8) must be a multiple of 4 bytes wide; got ", model_dim);
    // Copied as 32-bit words: the ungated dispatch of both backends copies
    // bits (memcpy, vector loads and stores) and never computes on them.
    dtype = A2A_FLOAT32;
    model_dim /= 4;
  }
  check_gated_kernel("dispatch", routing, dtype, model_dim, gates, gate_dtype, "x", x, "rows", rows, true);
  if (model_dim > 0) count(nullptr, Count::kKernelCalls);
  if (model_dim > 0) make_kernels(exec)->dispatch(*routing, x, dtype, model_dim, gates, gate_dtype, rows);
}

void combine(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* rows, a2a_dtype_t dtype,
             int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* y) {
  check_gated_kernel("combine", routing, dtype, model_dim, gates, gate_dtype, "rows", rows, "y", y, false);
  if (model_dim > 0) count(nullptr, Count::kKernelCalls);
  if (model_dim > 0) make_kernels(exec)->combine(*routing, rows, dtype, model_dim, gates, gate_dtype, y);
}

void gate_grad(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* tokens, const void* rows,
               a2a_dtype_t dtype, int64_t model_dim, a2a_dtype_t gate_dtype, void* grad_gates) {
  check_kernel_args("gate_grad", routing, dtype, model_dim, true, gate_dtype);
  const a2a_routing_t& r = *routing;
  Buffers("gate_grad")
      .routing(r)
      .input("tokens", tokens, data_bytes("gate_grad", r.num_tokens, model_dim, dtype))
      .input("rows", rows, data_bytes("gate_grad", r.num_rows, model_dim, dtype))
      .output("grad_gates", grad_gates, static_cast<size_t>(r.num_tokens * r.top_k) * dtype_size(gate_dtype));
  // With model_dim 0 every dot product is 0, which the kernel also writes.
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->gate_grad(r, tokens, rows, dtype, model_dim, gate_dtype, grad_gates);
}

}  // namespace a2a::moe
