// C++ API: header-only RAII wrappers over the C ABI in a2a.h. Failures throw
// a2a::Error carrying the status code and the message from a2a_get_last_error().
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "a2a/a2a.h"

namespace a2a {

class Error : public std::runtime_error {
 public:
  Error(a2a_status_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
  a2a_status_t status() const { return status_; }

 private:
  a2a_status_t status_;
};

inline void check(a2a_status_t status) {
  if (status != A2A_SUCCESS) throw Error(status, a2a_get_last_error());
}

struct Topology {
  int rank, size, local_rank, local_size, node, num_nodes;
};

// Owns an a2a_comm_t. Movable, not copyable.
class Communicator {
 public:
  // mpi_comm points to an MPI_Comm. Collective.
  explicit Communicator(const void* mpi_comm, const a2a_comm_config_t& config = A2A_COMM_CONFIG_INIT) {
    check(a2a_comm_create_mpi(mpi_comm, &config, &handle_));
  }
  // A NCCL communicator from a unique id that every rank received (see
  // a2a_comm_create_nccl). Collective.
  Communicator(const void* nccl_id, int size, int rank, const a2a_comm_config_t& config) {
    check(a2a_comm_create_nccl(nccl_id, size, rank, &config, &handle_));
  }
  // The same, with `control` beside NCCL for the check and the host values
  // (see a2a_comm_create_nccl_with_control). Collective.
  Communicator(const void* nccl_id, int size, int rank, const a2a_transport_ops_t& control,
               const a2a_comm_config_t& config) {
    check(a2a_comm_create_nccl_with_control(nccl_id, size, rank, &control, &config, &handle_));
  }
  // A host communicator over the caller's transport (see
  // a2a_comm_create_external). Collective.
  Communicator(const a2a_transport_ops_t& ops, int size, int rank, const a2a_comm_config_t& config) {
    check(a2a_comm_create_external(&ops, size, rank, &config, &handle_));
  }
  // Takes ownership of a handle from a C entry point (e.g. one not wrapped here).
  static Communicator adopt(a2a_comm_t handle) noexcept {
    Communicator communicator;
    communicator.handle_ = handle;
    return communicator;
  }
  ~Communicator() {
    if (handle_ != nullptr) a2a_comm_destroy(handle_);
  }
  Communicator(Communicator&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Communicator& operator=(Communicator&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  a2a_comm_t get() const { return handle_; }
  Topology topology() const {
    Topology t{};
    check(a2a_comm_topology(handle_, &t.rank, &t.size, &t.local_rank, &t.local_size, &t.node, &t.num_nodes));
    return t;
  }

  // See a2a_comm_irregular_reason: "" when 2DH can run.
  std::string irregular_reason() const {
    const char* reason = nullptr;
    check(a2a_comm_irregular_reason(handle_, &reason));
    return reason;
  }

  // See a2a_comm_cross_check.
  bool cross_check() const {
    int on = 1;
    check(a2a_comm_cross_check(handle_, &on));
    return on != 0;
  }

  // See a2a_comm_check (collective where a check is posted).
  void check_posted() { check(a2a_comm_check(handle_)); }
  // See a2a_comm_predicts_check.
  bool predicts_check() const {
    int on = 0;
    check(a2a_comm_predicts_check(handle_, &on));
    return on != 0;
  }

  // See a2a_counters: what this communicator's calls cost so far.
  a2a_counters_t counters() const {
    a2a_counters_t counters = A2A_COUNTERS_INIT;
    check(a2a_counters(handle_, &counters));
    return counters;
  }

  // See a2a_comm_split: collective; std::nullopt for color A2A_UNDEFINED.
  std::optional<Communicator> split(int color, int key) {
    a2a_comm_t child = nullptr;
    check(a2a_comm_split(handle_, color, key, &child));
    if (child == nullptr) return std::nullopt;
    return adopt(child);
  }

  // The CUDA stream of the following collectives (a cudaStream_t).
  void set_stream(void* stream) { check(a2a_comm_set_stream(handle_, stream)); }
  struct Device {
    int device_type, transport, cuda_device;
  };
  Device device() const {
    Device d{};
    check(a2a_comm_device(handle_, &d.device_type, &d.transport, &d.cuda_device));
    return d;
  }
  // An a2a_mpi_thread_level_t: what MPI granted the process.
  int mpi_thread_level() const {
    int level = A2A_MPI_THREAD_NONE;
    check(a2a_comm_mpi_thread_level(handle_, &level));
    return level;
  }

  size_t all_to_all_workspace_size(size_t count, a2a_dtype_t dtype, a2a_algo_t algo) const {
    size_t bytes = 0;
    check(a2a_all_to_all_workspace_size(handle_, count, dtype, algo, &bytes));
    return bytes;
  }
  void all_to_all(const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_algo_t algo,
                  void* workspace = nullptr, size_t workspace_bytes = 0) {
    check(a2a_all_to_all(handle_, send, recv, count, dtype, algo, workspace, workspace_bytes));
  }

  size_t all_to_all_flex_workspace_size(const std::vector<int64_t>& shape, int split_axis, int concat_axis,
                                        a2a_dtype_t dtype, a2a_algo_t algo) const {
    size_t bytes = 0;
    check(a2a_all_to_all_flex_workspace_size(handle_, shape.data(), static_cast<int>(shape.size()), split_axis,
                                             concat_axis, dtype, algo, &bytes));
    return bytes;
  }
  void all_to_all_flex(const void* send, void* recv, const std::vector<int64_t>& shape, int split_axis,
                       int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo, void* workspace = nullptr,
                       size_t workspace_bytes = 0) {
    check(a2a_all_to_all_flex(handle_, send, recv, shape.data(), static_cast<int>(shape.size()), split_axis,
                              concat_axis, dtype, algo, workspace, workspace_bytes));
  }

  void all_gather(const void* send, void* recv, size_t count, a2a_dtype_t dtype) {
    check(a2a_all_gather(handle_, send, recv, count, dtype));
  }
  void all_reduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t op) {
    check(a2a_all_reduce(handle_, send, recv, count, dtype, op));
  }
  void reduce_scatter(const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t op) {
    check(a2a_reduce_scatter(handle_, send, recv, count, dtype, op));
  }
  // counts: one entry per rank, in elements, the same on every rank.
  void all_gather_v(const void* send, void* recv, const std::vector<int64_t>& counts, a2a_dtype_t dtype) {
    require_one_count_per_rank("all_gather_v", counts);
    check(a2a_all_gather_v(handle_, send, recv, counts.data(), dtype));
  }
  void reduce_scatter_v(const void* send, void* recv, const std::vector<int64_t>& counts, a2a_dtype_t dtype,
                        a2a_reduce_op_t op) {
    require_one_count_per_rank("reduce_scatter_v", counts);
    check(a2a_reduce_scatter_v(handle_, send, recv, counts.data(), dtype, op));
  }

  // See a2a_comm_report_invalid: fails the collective on every rank.
  [[noreturn]] void report_invalid(const char* op, const std::string& message) {
    a2a_status_t status = a2a_comm_report_invalid(handle_, op, message.c_str());
    throw Error(status, a2a_get_last_error());  // message itself, or why the comm could not take part
  }

 private:
  Communicator() = default;
  // A list of another length fails every rank (the C call cannot see it).
  void require_one_count_per_rank(const char* op, const std::vector<int64_t>& counts) {
    const Topology topo = topology();
    if (counts.size() != static_cast<size_t>(topo.size))
      report_invalid(op, std::string(op) + " on rank " + std::to_string(topo.rank) + " of " +
                             std::to_string(topo.size) + ": counts has " + std::to_string(counts.size()) +
                             " entries; pass one per rank");
  }
  a2a_comm_t handle_ = nullptr;
};

// An uneven all-to-all with exchanged counts; see a2a_v_plan_create.
class VPlan {
 public:
  VPlan(Communicator& comm, const std::vector<int64_t>& send_counts, a2a_dtype_t dtype, a2a_algo_t algo,
        size_t row_elements = 1)
      : size_(comm.topology().size) {
    if (send_counts.size() != static_cast<size_t>(size_))
      comm.report_invalid("all_to_all_v (count exchange)",
                          "send_counts has " + std::to_string(send_counts.size()) + " entries, the communicator has " +
                              std::to_string(size_) + " ranks");
    check(a2a_v_plan_create(comm.get(), send_counts.data(), row_elements, dtype, algo, &handle_));
  }
  ~VPlan() {
    if (handle_ != nullptr) a2a_v_plan_destroy(handle_);
  }
  VPlan(VPlan&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)), size_(other.size_) {}
  VPlan(const VPlan&) = delete;
  VPlan& operator=(const VPlan&) = delete;
  VPlan& operator=(VPlan&&) = delete;

  std::vector<int64_t> recv_counts() const {
    std::vector<int64_t> counts(size_);
    check(a2a_v_plan_recv_counts(handle_, counts.data()));
    return counts;
  }
  size_t workspace_size() const {
    size_t bytes = 0;
    check(a2a_v_plan_workspace_size(handle_, &bytes));
    return bytes;
  }
  void execute(const void* send, void* recv, void* workspace = nullptr, size_t workspace_bytes = 0) {
    check(a2a_all_to_all_v(handle_, send, recv, workspace, workspace_bytes));
  }

 private:
  a2a_v_plan_t handle_ = nullptr;
  int size_;
};

// One uneven all-to-all in two halves (a2a_all_to_all_v_start / _finish):
// construct it (collective), size the output from recv_counts(), finish().
// Destroyed unfinished, it drops the rows sent here.
class VExchange {
 public:
  VExchange(Communicator& comm, const void* send, const std::vector<int64_t>& send_counts, a2a_dtype_t dtype,
            a2a_algo_t algo, size_t row_elements = 1)
      : recv_counts_(comm.topology().size) {
    if (send_counts.size() != recv_counts_.size())
      comm.report_invalid("all_to_all_v", "send_counts has " + std::to_string(send_counts.size()) +
                                              " entries, the communicator has " +
                                              std::to_string(recv_counts_.size()) + " ranks");
    check(a2a_all_to_all_v_start(comm.get(), send, send_counts.data(), row_elements, dtype, algo,
                                 recv_counts_.data(), &handle_));
  }
  ~VExchange() { drop(); }
  VExchange(const VExchange&) = delete;
  VExchange& operator=(const VExchange&) = delete;

  const std::vector<int64_t>& recv_counts() const { return recv_counts_; }
  size_t workspace_size() const {
    size_t bytes = 0;
    if (handle_ != nullptr) check(a2a_v_exchange_workspace_size(handle_, &bytes));
    return bytes;
  }
  void finish(void* recv, void* workspace = nullptr, size_t workspace_bytes = 0) {
    if (handle_ == nullptr) throw Error(A2A_ERROR_INVALID_ARGUMENT, "all_to_all_v: this exchange was finished or dropped");
    check(a2a_all_to_all_v_finish(std::exchange(handle_, nullptr), recv, workspace, workspace_bytes));
  }
  void drop() {
    if (handle_ != nullptr) a2a_all_to_all_v_drop(std::exchange(handle_, nullptr));
  }

 private:
  a2a_v_exchange_t handle_ = nullptr;
  std::vector<int64_t> recv_counts_;
};

// MoE routing and kernels (see a2a.h). `comm` may be nullptr for a local call.
// See a2a_counters: the process's totals, over every communicator and the
// calls made without one.
inline a2a_counters_t process_counters() {
  a2a_counters_t counters = A2A_COUNTERS_INIT;
  check(a2a_counters(nullptr, &counters));
  return counters;
}

inline size_t route_workspace_size(const a2a_exec_t& exec, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  size_t bytes = 0;
  check(a2a_route_workspace_size(&exec, num_tokens, top_k, num_experts, &bytes));
  return bytes;
}

inline a2a_route_info_t route(const a2a_exec_t& exec, const Communicator* comm, const void* indices,
                              a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              const int64_t* token_order, int64_t capacity, double capacity_setting,
                              void* workspace, size_t workspace_bytes, int64_t* locations, int64_t* counts,
                              int64_t* expert_offsets) {
  a2a_route_info_t info{};
  check(a2a_route(&exec, comm ? comm->get() : nullptr, indices, index_dtype, num_tokens, top_k, num_experts,
                  token_order, capacity, capacity_setting, workspace, workspace_bytes, locations, counts,
                  expert_offsets, &info));
  return info;
}

inline a2a_route_info_t route_host_counts(const a2a_exec_t& exec, const Communicator* comm, const void* indices,
                                          a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                                          int64_t num_experts, const int64_t* token_order, int64_t capacity,
                                          double capacity_setting, void* workspace, size_t workspace_bytes,
                                          int64_t* locations, int64_t* counts, int64_t* expert_offsets,
                                          int64_t* host_counts) {
  a2a_route_info_t info{};
  check(a2a_route_host_counts(&exec, comm ? comm->get() : nullptr, indices, index_dtype, num_tokens, top_k,
                              num_experts, token_order, capacity, capacity_setting, workspace, workspace_bytes,
                              locations, counts, expert_offsets, host_counts, &info));
  return info;
}

inline a2a_route_info_t route_capacities(const a2a_exec_t& exec, const Communicator* comm, const void* indices,
                                         a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                                         int64_t num_experts, const int64_t* token_order, const int64_t* capacities,
                                         void* workspace, size_t workspace_bytes, int64_t* locations,
                                         int64_t* counts, int64_t* expert_offsets, int64_t* final_capacities) {
  a2a_route_info_t info{};
  check(a2a_route_capacities(&exec, comm ? comm->get() : nullptr, indices, index_dtype, num_tokens, top_k,
                             num_experts, token_order, capacities, workspace, workspace_bytes, locations, counts,
                             expert_offsets, final_capacities, &info));
  return info;
}

inline void route_fixed(const a2a_exec_t& exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                        int64_t top_k, int64_t num_experts, const int64_t* token_order, int64_t capacity,
                        void* workspace, size_t workspace_bytes, int64_t* locations, int64_t* counts,
                        int64_t* expert_offsets) {
  check(a2a_route_fixed(&exec, indices, index_dtype, num_tokens, top_k, num_experts, token_order, capacity, workspace,
                        workspace_bytes, locations, counts, expert_offsets));
}

inline int64_t route_fixed_dropped(const a2a_exec_t& exec, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   const void* workspace, size_t workspace_bytes) {
  int64_t num_dropped = 0;
  check(a2a_route_fixed_dropped(&exec, num_tokens, top_k, num_experts, workspace, workspace_bytes, &num_dropped));
  return num_dropped;
}

inline void moe_dispatch(const a2a_exec_t& exec, const a2a_routing_t& routing, const void* x, a2a_dtype_t dtype,
                         int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* rows) {
  check(a2a_moe_dispatch(&exec, &routing, x, dtype, model_dim, gates, gate_dtype, rows));
}

inline void moe_combine(const a2a_exec_t& exec, const a2a_routing_t& routing, const void* rows, a2a_dtype_t dtype,
                        int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* y) {
  check(a2a_moe_combine(&exec, &routing, rows, dtype, model_dim, gates, gate_dtype, y));
}

inline void moe_gate_grad(const a2a_exec_t& exec, const a2a_routing_t& routing, const void* tokens, const void* rows,
                          a2a_dtype_t dtype, int64_t model_dim, a2a_dtype_t gate_dtype, void* grad_gates) {
  check(a2a_moe_gate_grad(&exec, &routing, tokens, rows, dtype, model_dim, gate_dtype, grad_gates));
}

// The low-latency dispatch and combine (see a2a.h). Owns the handle; the
// communicator must outlive it.
class LowLatency {
 public:
  LowLatency(Communicator& comm, const a2a_low_latency_config_t& config) {
    check(a2a_low_latency_create(comm.get(), &config, &handle_));
  }
  ~LowLatency() {
    if (handle_ != nullptr) a2a_low_latency_destroy(handle_);
  }
  LowLatency(const LowLatency&) = delete;
  LowLatency& operator=(const LowLatency&) = delete;

  size_t workspace_size() const {
    size_t bytes = 0;
    check(a2a_low_latency_workspace_size(handle_, &bytes));
    return bytes;
  }
  int64_t expert_capacity() const {
    int64_t rows = 0;
    check(a2a_low_latency_expert_capacity(handle_, &rows));
    return rows;
  }
  void dispatch(const a2a_exec_t& exec, void* workspace, size_t workspace_bytes, const void* x, int64_t num_tokens,
                const void* indices, a2a_dtype_t index_dtype, void* recv, int64_t* recv_counts) {
    check(a2a_low_latency_dispatch(handle_, &exec, workspace, workspace_bytes, x, num_tokens, indices, index_dtype,
                                   recv, recv_counts));
  }
  void combine(const a2a_exec_t& exec, void* workspace, size_t workspace_bytes, const void* expert_out,
               const void* gates, a2a_dtype_t gate_dtype, void* y) {
    check(a2a_low_latency_combine(handle_, &exec, workspace, workspace_bytes, expert_out, gates, gate_dtype, y));
  }
  void check_status(const a2a_exec_t& exec, const void* workspace, size_t workspace_bytes) {
    check(a2a_low_latency_check(handle_, &exec, workspace, workspace_bytes));
  }

 private:
  a2a_low_latency_t handle_ = nullptr;
};

// FP8 rows with block scales (see a2a.h).
struct Fp8PackedLayout {
  int64_t scale_offset;
  int64_t row_bytes;
};
inline Fp8PackedLayout fp8_packed_layout(int64_t cols, int64_t block) {
  Fp8PackedLayout layout{};
  check(a2a_fp8_packed_layout(cols, block, &layout.scale_offset, &layout.row_bytes));
  return layout;
}
inline void quantize_fp8(const a2a_exec_t& exec, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& out) {
  check(a2a_quantize_fp8(&exec, x, dtype, &out));
}
inline void dequantize_fp8(const a2a_exec_t& exec, const a2a_fp8_rows_t& in, a2a_dtype_t dtype, void* y) {
  check(a2a_dequantize_fp8(&exec, &in, dtype, y));
}

// The fused top-k gate (a2a_top_k_gate in a2a.h).
inline size_t top_k_gate_workspace_size(const a2a_top_k_gate_t& gate) {
  size_t bytes = 0;
  check(a2a_top_k_gate_workspace_size(&gate, &bytes));
  return bytes;
}
inline void top_k_gate(const a2a_exec_t& exec, const a2a_top_k_gate_t& gate, const void* logits, void* scores,
                       int64_t* indices, void* gates, void* share, void* l_aux, void* workspace) {
  check(a2a_top_k_gate(&exec, &gate, logits, scores, indices, gates, share, l_aux, workspace));
}
inline void top_k_gate_backward(const a2a_exec_t& exec, const a2a_top_k_gate_t& gate, const void* scores,
                                const int64_t* indices, const void* share, const void* d_gates, const void* d_l_aux,
                                void* d_logits) {
  check(a2a_top_k_gate_backward(&exec, &gate, scores, indices, share, d_gates, d_l_aux, d_logits));
}

// Expert-specific operators (see a2a.h).
inline int64_t es_index_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile) {
  int64_t slots = 0;
  check(a2a_es_index_capacity(num_tokens, top_k, num_experts, tile, &slots));
  return slots;
}

inline size_t es_index_workspace_size(const a2a_exec_t& exec, int64_t num_tokens, int64_t top_k,
                                      int64_t num_experts) {
  size_t bytes = 0;
  check(a2a_es_index_workspace_size(&exec, num_tokens, top_k, num_experts, &bytes));
  return bytes;
}

// Returns num_slots.
inline int64_t es_index(const a2a_exec_t& exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                        int64_t top_k, int64_t num_experts, int64_t tile, void* workspace, size_t workspace_bytes,
                        int64_t* slots, int64_t max_slots, int64_t* expert_starts, int64_t* counts) {
  int64_t num_slots = 0;
  check(a2a_es_index(&exec, indices, index_dtype, num_tokens, top_k, num_experts, tile, workspace, workspace_bytes,
                     slots, max_slots, expert_starts, counts, &num_slots));
  return num_slots;
}

inline size_t esmm_workspace_size(const a2a_es_index_t& index, a2a_es_rows_t y_rows, int64_t n, a2a_dtype_t dtype) {
  size_t bytes = 0;
  check(a2a_esmm_workspace_size(&index, y_rows, n, dtype, &bytes));
  return bytes;
}

inline void esmm(const a2a_exec_t& exec, const a2a_es_index_t& index, const void* x, a2a_es_rows_t x_rows, int64_t k,
                 const void* w, a2a_es_weight_layout_t w_layout, const void* bias, const void* gates,
                 a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* y, a2a_es_rows_t y_rows, void* workspace,
                 size_t workspace_bytes) {
  check(a2a_esmm(&exec, &index, x, x_rows, k, w, w_layout, bias, gates, gate_dtype, dtype, n, y, y_rows, workspace,
                 workspace_bytes));
}

inline void ess(const a2a_exec_t& exec, const a2a_es_index_t& index, const void* x, a2a_es_rows_t x_rows,
                const void* gates, a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* out) {
  check(a2a_ess(&exec, &index, x, x_rows, gates, gate_dtype, dtype, n, out));
}

inline void estmm(const a2a_exec_t& exec, const a2a_es_index_t& index, const void* a, a2a_es_rows_t a_rows,
                  int64_t a_dim, const void* b, a2a_es_rows_t b_rows, int64_t b_dim, const void* gates,
                  a2a_dtype_t gate_dtype, a2a_dtype_t dtype, void* out) {
  check(a2a_estmm(&exec, &index, a, a_rows, a_dim, b, b_rows, b_dim, gates, gate_dtype, dtype, out));
}

inline std::vector<char> nccl_unique_id() {
  std::vector<char> id(A2A_NCCL_UNIQUE_ID_BYTES);
  check(a2a_nccl_unique_id(id.data()));
  return id;
}

inline void transpose_chunks(const a2a_exec_t& exec, void* dst, const void* src, size_t rows, size_t cols,
                             size_t chunk_bytes) {
  check(a2a_transpose_chunks(&exec, dst, src, rows, cols, chunk_bytes));
}

inline void copy_ranges(const a2a_exec_t& exec, void* dst, const void* src, const a2a_copy_range_t* ranges,
                        size_t count) {
  check(a2a_copy_ranges(&exec, dst, src, ranges, count));
}
inline void copy_ranges(const a2a_exec_t& exec, void* dst, const void* src, const std::vector<a2a_copy_range_t>& ranges) {
  copy_ranges(exec, dst, src, ranges.data(), ranges.size());
}

}  // namespace a2a
