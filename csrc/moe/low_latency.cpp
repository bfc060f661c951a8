#include "moe/low_latency.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/arguments.hpp"
#include "moe/fp8.hpp"

namespace a2a::moe {

namespace {

// The config's own checks ("" when it is valid).
std::string config_error(const a2a_low_latency_config_t& c, int world) {
  if (c.struct_size < sizeof(a2a_low_latency_config_t))
    return cat("config.struct_size is ", c.struct_size, "; start from A2A_LOW_LATENCY_CONFIG_INIT");
  if (c.max_tokens < 1) return cat("max_tokens is ", c.max_tokens, "; it must be >= 1");
  if (c.num_experts < 1 || c.num_experts % world != 0)
    return cat("num_experts ", c.num_experts, " is not a positive multiple of the ", world, " ranks");
  if (c.top_k < 1) return cat("top_k is ", c.top_k, "; it must be >= 1");
  if (c.row_bytes < 1) return cat("row_bytes is ", c.row_bytes, "; it must be >= 1");
  if (c.model_dim < 1) return cat("model_dim is ", c.model_dim, "; it must be >= 1");
  if (!is_float(c.dtype)) return cat("dtype ", dtype_name(c.dtype), " is not float32, float64, float16 or bfloat16");
  // Keeps every byte count below in int64 (a slot row of a few MiB, at most 2^20 tokens).
  if (c.max_tokens > (int64_t{1} << 20) || c.top_k > 1024 || c.row_bytes > (int64_t{1} << 30) ||
      c.model_dim > (int64_t{1} << 27) || c.num_experts > (int64_t{1} << 24))
    return cat("the sizes (max_tokens ", c.max_tokens, ", top_k ", c.top_k, ", row_bytes ", c.row_bytes,
               ", model_dim ", c.model_dim, ", num_experts ", c.num_experts, ") are beyond a low-latency call's");
  return "";
}


// Why a call's buffers are unusable ("" when they are fine): `regions` are
// (name, pointer, bytes, written).
struct Region {
  const char* name;
  const void* data;
  size_t bytes;
  bool written;
};
std::string buffers_error(const char* op, std::initializer_list<Region> regions) {
  try {
    Buffers buffers(op);
    for (const Region& r : regions) {
      if (r.written)
        buffers.output(r.name, r.data, r.bytes);
      else
        buffers.input(r.name, r.data, r.bytes);
    }
  } catch (const Failure& failure) {
    return failure.what();
  }
  return "";
}

// Every index of a host (T, k) table below num_experts, or the message naming the first that is not.
std::string indices_error(const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts) {
  for (int64_t c = 0; c < num_tokens * top_k; ++c) {
    const int64_t e = load_index(indices, index_dtype, c);
    if (e >= num_experts)
      return cat("indices[", c / top_k, ", ", c % top_k, "] = ", e, " is out of range for num_experts ", num_experts,
                 " (valid: 0..", num_experts - 1, ", or negative for a choice that is not routed)");
  }
  return "";
}

a2a_exec_t exec_of(const a2a_exec_t* exec) {
  a2a_exec_t e = A2A_EXEC_CPU_INIT;
  if (exec != nullptr) e = *exec;
  return e;
}

}  // namespace

LowLatency::LowLatency(Comm& comm, const a2a_low_latency_config_t& config)
    : comm_(comm), comm_lifetime_(comm.lifetime()) {
  const char* op = "low_latency_create";
  std::string error = config_error(config, comm.size());
  comm.agree(op,
             {{"max_tokens", config.max_tokens}, {"num_experts", config.num_experts}, {"top_k", config.top_k},
              {"row_bytes", config.row_bytes}, {"model_dim", config.model_dim}, {"dtype", config.dtype}},
             error.empty() ? "" : cat(op, " on rank ", comm.rank(), ": ", error));
  layout_ = low_latency_layout(config, comm.size(), comm.rank());
  sent_.assign(static_cast<size_t>(comm.size()), 0);
  received_.assign(static_cast<size_t>(comm.size()), 0);
}

// The workspace carries the messages: without it this rank cannot take part
// (the one error that is this rank's alone).
void LowLatency::require_workspace(const char* op, const Comm& comm, const void* workspace,
                                   size_t workspace_bytes) const {
  require(workspace != nullptr && workspace_bytes >= layout_.workspace_bytes, op, " on rank ", comm.rank(),
          ": the workspace is ", workspace == nullptr ? "NULL" : cat(workspace_bytes, " bytes"), "; it needs ",
          layout_.workspace_bytes, " (a2a_low_latency_workspace_size)");
}

Comm& LowLatency::usable_comm(const char* op) const {
  if (comm_lifetime_.expired())
    fail(A2A_ERROR_INVALID_ARGUMENT, op, ": the communicator of this handle was destroyed; a handle is used with "
         "the communicator it was made on, while that communicator exists");
  comm_.check_usable(op);
  return comm_;
}

void LowLatency::exchange(const char* op, char* workspace, bool host, bool rejected, int64_t row,
                          const std::vector<int64_t>& sent) {
  Transport& transport = comm_.transport();
  const LowLatencyLayout& l = layout_;
  // CPU: a slot's header and its rows and no more (the header alone when this
  // rank rejected its input); a receive takes up to a whole slot from a peer,
  // exactly what was sent from itself. CUDA: whole slots, so that no size
  // depends on counts that stay on the device.
  const size_t whole = static_cast<size_t>(l.slot_bytes);
  const size_t header = sizeof(LowLatencyHeader);
  const auto bytes = [&](int peer) {
    return !host ? whole : rejected ? header : header + static_cast<size_t>(sent[peer] * row);
  };
  comm_.run(op, [&] {
    transport.group_start();
    try {
      for (int peer = 0; peer < l.world; ++peer) {
        const size_t at = static_cast<size_t>(peer) * whole;
        transport.recv(Span::contiguous(workspace + l.recv + at, host && peer == l.rank ? bytes(peer) : whole), peer);
        transport.send(Span::contiguous(workspace + l.send + at, bytes(peer)), peer);
      }
    } catch (...) {
      transport.cancel_group();
      throw;
    }
    transport.group_end();
  });
}

void LowLatency::dispatch(const a2a_exec_t* exec, void* workspace, size_t workspace_bytes, const void* x,
                          int64_t num_tokens, const void* indices, a2a_dtype_t index_dtype, void* recv,
                          int64_t* recv_counts) {
  const char* op = "low_latency_dispatch";
  Comm& comm = usable_comm(op);
  const LowLatencyLayout& l = layout_;
  const a2a_exec_t e = exec_of(exec);
  const bool host = e.device_type == A2A_DEVICE_CPU;
  require(e.device_type == comm.device_type(), op, ": exec runs on ", e.device_type == A2A_DEVICE_CPU ? "the CPU" : "CUDA",
          " but the communicator moves ", comm.device_type() == A2A_DEVICE_CPU ? "host" : "CUDA", " memory");
  require_workspace(op, comm, workspace, workspace_bytes);
  char* ws = static_cast<char*>(workspace);
  const uint32_t sequence = ++sequence_;
  num_tokens_ = -1;
  std::string error;
  if (num_tokens < 0 || num_tokens > l.max_tokens)
    error = cat("num_tokens is ", num_tokens, "; this handle takes 0..", l.max_tokens, " (max_tokens)");
  else if (!is_index(index_dtype))
    error = cat("index dtype ", dtype_name(index_dtype), " is not int32 or int64");
  if (error.empty()) {
    const size_t tokens = static_cast<size_t>(num_tokens);
    error = buffers_error(op, {{"x", x, tokens * static_cast<size_t>(l.row_bytes), false},
                               {"indices", indices, tokens * static_cast<size_t>(l.top_k) * dtype_size(index_dtype), false},
                               {"workspace", workspace, l.workspace_bytes, true},
                               {"recv", recv, static_cast<size_t>(l.local_experts * l.expert_capacity * l.row_bytes), true},
                               {"recv_counts", recv_counts, static_cast<size_t>(l.local_experts) * sizeof(int64_t), true}});
  }
  if (error.empty() && host) error = indices_error(indices, index_dtype, num_tokens, l.top_k, l.num_experts);
  auto kernels = make_kernels(&e);
  count(&comm.counters(), Count::kKernelCalls, 2);  // pack (or reject), unpack
  std::fill(sent_.begin(), sent_.end(), 0);
  if (error.empty())
    kernels->low_latency_pack(l, x, num_tokens, indices, index_dtype, sequence, ws, sent_.data());
  else
    kernels->low_latency_reject(l, kLowLatencyDispatch, sequence, ws);
  exchange(op, ws, host, !error.empty(), l.dispatch_row, sent_);
  if (!error.empty()) fail(A2A_ERROR_INVALID_ARGUMENT, op, " on rank ", comm.rank(), " of ", comm.size(), ": ", error);
  kernels->low_latency_unpack(l, sequence, ws, recv, recv_counts, received_.data());
  num_tokens_ = num_tokens;
}

void LowLatency::combine(const a2a_exec_t* exec, void* workspace, size_t workspace_bytes, const void* expert_out,
                         const void* gates, a2a_dtype_t gate_dtype, void* y) {
  const char* op = "low_latency_combine";
  Comm& comm = usable_comm(op);
  const LowLatencyLayout& l = layout_;
  const a2a_exec_t e = exec_of(exec);
  const bool host = e.device_type == A2A_DEVICE_CPU;
  require_workspace(op, comm, workspace, workspace_bytes);
  char* ws = static_cast<char*>(workspace);
  const uint32_t sequence = ++sequence_;
  const int64_t num_tokens = num_tokens_;
  num_tokens_ = -1;  // one combine per dispatch
  std::string error;
  if (num_tokens < 0)
    error = "no dispatch precedes this combine (each dispatch is followed by one combine, on the same workspace)";
  else if (gates != nullptr && gate_dtype != A2A_FLOAT32 && gate_dtype != l.dtype)
    error = cat("gate dtype ", dtype_name(gate_dtype), " must be float32 or the outputs' ", dtype_name(l.dtype));
  if (error.empty()) {
    const size_t element = dtype_size(l.dtype), tokens = static_cast<size_t>(num_tokens);
    error = buffers_error(
        op, {{"expert_out", expert_out, static_cast<size_t>(l.local_experts * l.expert_capacity * l.model_dim) * element, false},
             {"gates", gates, gates == nullptr ? 0 : tokens * static_cast<size_t>(l.top_k) * dtype_size(gate_dtype), false},
             {"workspace", workspace, l.workspace_bytes, true},
             {"y", y, tokens * static_cast<size_t>(l.model_dim) * element, true}});
  }
  auto kernels = make_kernels(&e);
  count(&comm.counters(), Count::kKernelCalls, 2);  // return (or reject), combine
  if (error.empty())
    kernels->low_latency_return(l, expert_out, sequence, ws);
  else
    kernels->low_latency_reject(l, kLowLatencyCombine, sequence, ws);
  exchange(op, ws, host, !error.empty(), l.combine_row, received_);  // back to each source the rows it sent
  if (!error.empty()) fail(A2A_ERROR_INVALID_ARGUMENT, op, " on rank ", comm.rank(), " of ", comm.size(), ": ", error);
  kernels->low_latency_combine(l, num_tokens, gates, gate_dtype, sequence, ws, y, host ? sent_.data() : nullptr);
}

void LowLatency::check(const a2a_exec_t* exec, const void* workspace, size_t workspace_bytes) {
  const char* op = "low_latency_check";
  Comm& comm = usable_comm(op);
  require_workspace(op, comm, workspace, workspace_bytes);
  const a2a_exec_t e = exec_of(exec);
  const LowLatencyStatus status = make_kernels(&e)->low_latency_status(layout_, static_cast<const char*>(workspace));
  const std::string where = cat(" on rank ", comm.rank(), " of ", comm.size(), ": ");
  if (status.bad_choice != 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "low_latency_dispatch", where, "indices[", (status.bad_choice - 1) / layout_.top_k,
         ", ", (status.bad_choice - 1) % layout_.top_k, "] = ",
         static_cast<int64_t>(static_cast<uint64_t>(status.bad_value) - 1u),
         " is out of range for num_experts ", layout_.num_experts, " (the choice was not sent)");
  if (status.rejected_by != 0)
    fail(A2A_ERROR_REMOTE, "low_latency", where, "rank(s) ", status.rejected_by - 1,
         " rejected their input; this rank's results of that call are not valid");
  if (status.mismatched_from != 0)
    fail(A2A_ERROR_MISMATCH, "low_latency", where, "a message from rank ", status.mismatched_from - 1,
         " belongs to another call (a dispatch met a combine, or the ranks' calls are out of step)");
}

}  // namespace a2a::moe
