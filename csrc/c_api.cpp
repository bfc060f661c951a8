// The C ABI: every function catches everything, records the message for
// a2a_get_last_error() and returns a status code.
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>

#include "a2a/a2a.h"
#include "a2a/a2a_testing.h"
#include "core/collectives.hpp"
#include "core/counters.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "external/external_comm.hpp"
#include "moe/es_ops.hpp"
#include "moe/fp8_ops.hpp"
#include "moe/gating_ops.hpp"
#include "moe/low_latency.hpp"
#include "moe/moe.hpp"
#include "setup/backends.hpp"
#include "setup/exec.hpp"
#include "setup/mpi_comm.hpp"
#include "setup/nccl_comm.hpp"
#include "setup/testing_comm.hpp"

struct a2a_comm {
  std::unique_ptr<a2a::Comm> impl;
};

struct a2a_low_latency {
  std::unique_ptr<a2a::moe::LowLatency> impl;
  a2a::Comm* comm = nullptr;
};

struct a2a_v_plan {
  std::unique_ptr<a2a::VPlan> impl;
  a2a::Comm* comm;  // the plan's communicator, for the call guard
};

struct a2a_v_exchange {
  std::unique_ptr<a2a::VExchange> impl;
  a2a::Comm* comm;  // for the call guard
};

namespace {

thread_local std::string last_error;

template <typename Fn>
a2a_status_t guarded(Fn&& fn) {
  a2a::process_counters().add(a2a::Count::kCalls);
  try {
    fn();
    last_error.clear();
    return A2A_SUCCESS;
  } catch (const a2a::Failure& e) {
    last_error = e.what();
    return e.status();
  } catch (const std::bad_alloc&) {
    last_error = "out of host memory";
    return A2A_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    last_error = std::string("internal error: ") + e.what();
    return A2A_ERROR_INTERNAL;
  } catch (...) {
    last_error = "internal error: unknown exception";
    return A2A_ERROR_INTERNAL;
  }
}

template <typename T>
T* require_handle(T* handle, const char* what) {
  if (handle == nullptr || handle->impl == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, what, " is NULL or destroyed");
  return handle;
}

void require_out(const void* pointer, const char* what) {
  if (pointer == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "output argument ", what, " is NULL");
}

MPI_Comm mpi_comm_at(const void* mpi_comm) {
  if (mpi_comm == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "mpi_comm must point to an MPI_Comm");
  return *static_cast<const MPI_Comm*>(mpi_comm);
}

// Runs fn(comm) inside the communicator's CallGuard (core/call_guard.hpp):
// every call that communicates, and set_stream, which changes the stream
// that a call inside would use.
template <typename Fn>
a2a_status_t on_comm(a2a_comm_t comm, const char* op, Fn&& fn, bool communicates = true) {
  return guarded([&] {
    a2a::Comm& impl = *require_handle(comm, "comm")->impl;
    const a2a::CallGuard guard(impl.call_gate(), op, impl.rank(), communicates);
    fn(impl);
  });
}

// A call on a handle: under its communicator's call gate.
template <typename Fn>
a2a_status_t on_low_latency(a2a_low_latency_t handle, const char* op, Fn&& fn) {
  return guarded([&] {
    a2a_low_latency* h = require_handle(handle, "handle");
    const a2a::CallGuard guard(h->comm->call_gate(), op, h->comm->rank(), true);
    fn(*h->impl);
  });
}

// Sets *comm to the communicator that make() returns, or to NULL when it fails.
template <typename Make>
a2a_status_t create_comm(a2a_comm_t* comm, Make&& make) {
  return guarded([&] {
    require_out(comm, "comm");
    *comm = nullptr;
    auto handle = std::make_unique<a2a_comm>();
    handle->impl = make();
    *comm = handle.release();
  });
}

// A route call: under the comm's call gate when it is collective (a local
// route needs none); fn(impl) returns the info.
template <typename Fn>
a2a_status_t routed(a2a_comm_t comm, a2a_route_info_t* info, Fn&& fn) {
  return guarded([&] {
    require_out(info, "info");
    a2a::Comm* impl = comm == nullptr ? nullptr : require_handle(comm, "comm")->impl.get();
    std::optional<a2a::CallGuard> guard;
    if (impl != nullptr) guard.emplace(impl->call_gate(), "route", impl->rank());
    *info = fn(impl);
  });
}

}  // namespace

extern "C" {

const char* a2a_get_last_error(void) { return last_error.c_str(); }

const char* a2a_status_string(a2a_status_t status) {
  switch (status) {
    case A2A_SUCCESS: return "success";
    case A2A_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case A2A_ERROR_MISMATCH: return "arguments differ across ranks";
    case A2A_ERROR_TIMEOUT: return "timed out";
    case A2A_ERROR_TRANSPORT: return "transport error";
    case A2A_ERROR_UNSUPPORTED: return "unsupported";
    case A2A_ERROR_REMOTE: return "another rank rejected its input";
    case A2A_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

size_t a2a_dtype_size(a2a_dtype_t dtype) { return a2a::dtype_size(dtype); }

const char* a2a_build_config(void) {
#if A2A_HAVE_CUDA
  const char* cuda = "1";
  const char* cuda_archs = A2A_CUDA_ARCHS_STRING;
#else
  const char* cuda = "0";
  const char* cuda_archs = "";
#endif
#if A2A_HAVE_NCCL
  const std::string nccl = a2a::cat("1;nccl_version=", A2A_NCCL_VERSION_STRING);
#else
  const std::string nccl = "0";
#endif
  static const std::string text = a2a::cat("version=", A2A_VERSION_MAJOR, ".", A2A_VERSION_MINOR, ".",
                                            A2A_VERSION_PATCH, ";mpi=1;mpi_version=", MPI_VERSION, ".",
                                            MPI_SUBVERSION, ";cuda=", cuda, ";nccl=", nccl, ";cuda_archs=", cuda_archs);
  return text.c_str();
}

namespace {

a2a_comm_config_t read_config(const a2a_comm_config_t* config) {
  a2a_comm_config_t options = A2A_COMM_CONFIG_INIT;
  if (config != nullptr) {
    if (config->struct_size < offsetof(a2a_comm_config_t, local_size) + sizeof(int) ||
        config->struct_size > sizeof(a2a_comm_config_t))
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "config->struct_size ", config->struct_size,
                " is not a size this library knows; start from A2A_COMM_CONFIG_INIT");
    // A field the caller's struct ends inside of (e.g. device_type in the
    // padding of the older 32-byte struct) keeps its default.
    size_t bytes = config->struct_size;
    for (size_t field : {offsetof(a2a_comm_config_t, device_type), offsetof(a2a_comm_config_t, transport),
                         offsetof(a2a_comm_config_t, cuda_device), offsetof(a2a_comm_config_t, cross_check)})
      if (bytes < field + sizeof(int)) bytes = std::min(bytes, field);
    std::memcpy(&options, config, bytes);
  }
  return options;
}

// The checks of a caller's ops before anything of them is read.
void check_ops(const a2a_transport_ops_t* ops, const char* name) {
  if (ops == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, name, " must not be NULL");
  if (ops->struct_size != sizeof(a2a_transport_ops_t))
    a2a::fail(A2A_ERROR_INVALID_ARGUMENT, name, "->struct_size ", ops->struct_size,
              " is not sizeof(a2a_transport_ops_t) = ", sizeof(a2a_transport_ops_t));
}

// read_config for a creation that owns `ops`: as documented, they are
// released on any failure, this one included.
a2a_comm_config_t read_config_releasing(const a2a_comm_config_t* config, const a2a_transport_ops_t& ops) {
  try {
    return read_config(config);
  } catch (...) {
    if (ops.release != nullptr) ops.release(ops.user);
    throw;
  }
}

}  // namespace

a2a_status_t a2a_comm_create_mpi(const void* mpi_comm, const a2a_comm_config_t* config, a2a_comm_t* comm) {
  return create_comm(comm, [&] {
    const MPI_Comm parent = mpi_comm_at(mpi_comm);
    return a2a::create_mpi_comm(parent, read_config(config));
  });
}

a2a_status_t a2a_nccl_unique_id(void* id) {
  return guarded([&] {
    require_out(id, "id");
    a2a::nccl_unique_id(id);
  });
}

a2a_status_t a2a_comm_create_nccl(const void* id, int size, int rank, const a2a_comm_config_t* config,
                                  a2a_comm_t* comm) {
  return create_comm(comm, [&] { return a2a::create_nccl_comm(id, size, rank, read_config(config)); });
}

a2a_status_t a2a_comm_create_nccl_with_control(const void* id, int size, int rank, const a2a_transport_ops_t* control,
                                               const a2a_comm_config_t* config, a2a_comm_t* comm) {
  return create_comm(comm, [&] {
    check_ops(control, "control");
    return a2a::create_nccl_comm(id, size, rank, read_config_releasing(config, *control), control);
  });
}

a2a_status_t a2a_comm_create_external(const a2a_transport_ops_t* ops, int size, int rank,
                                      const a2a_comm_config_t* config, a2a_comm_t* comm) {
  return create_comm(comm, [&] {
    check_ops(ops, "ops");
    return a2a::create_external_comm(*ops, size, rank, read_config_releasing(config, *ops));
  });
}

a2a_status_t a2a_comm_split(a2a_comm_t comm, int color, int key, a2a_comm_t* out) {
  if (out != nullptr) *out = nullptr;
  return on_comm(comm, "split", [&](a2a::Comm& c) {
    require_out(out, "out");
    auto handle = std::make_unique<a2a_comm>();
    handle->impl = c.split(color, key);
    if (handle->impl != nullptr) *out = handle.release();
  });
}

a2a_status_t a2a_comm_check(a2a_comm_t comm) {
  return on_comm(comm, "check", [&](a2a::Comm& c) { c.check_posted("check"); });
}

a2a_status_t a2a_comm_predicts_check(a2a_comm_t comm, int* on) {
  return guarded([&] {
    if (on == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "on must not be NULL");
    *on = require_handle(comm, "comm")->impl->predicts_check() ? 1 : 0;
  });
}

a2a_status_t a2a_comm_set_stream(a2a_comm_t comm, void* stream) {
  return on_comm(comm, "set_stream", [&](a2a::Comm& c) { c.set_stream(stream); }, false);
}

a2a_status_t a2a_comm_device(a2a_comm_t comm, int* device_type, int* transport, int* cuda_device) {
  return guarded([&] {
    a2a::Comm& impl = *require_handle(comm, "comm")->impl;
    if (device_type) *device_type = impl.device_type();
    if (transport) *transport = impl.transport_kind();
    if (cuda_device) *cuda_device = a2a::cuda_device_of(impl.device());
  });
}

a2a_status_t a2a_comm_destroy(a2a_comm_t comm) {
  return guarded([&] { delete comm; });
}

a2a_status_t a2a_comm_mpi_thread_level(a2a_comm_t comm, int* level) {
  return guarded([&] {
    require_out(level, "level");
    *level = require_handle(comm, "comm")->impl->call_gate().mpi_thread_level();
  });
}

a2a_status_t a2a_comm_topology(a2a_comm_t comm, int* rank, int* size, int* local_rank, int* local_size, int* node,
                               int* num_nodes) {
  return guarded([&] {
    const a2a::Topology& topo = require_handle(comm, "comm")->impl->topology();
    if (rank) *rank = topo.rank;
    if (size) *size = topo.size;
    if (local_rank) *local_rank = topo.local_rank;
    if (local_size) *local_size = topo.local_size;
    if (node) *node = topo.node;
    if (num_nodes) *num_nodes = topo.num_nodes;
  });
}

a2a_status_t a2a_comm_irregular_reason(a2a_comm_t comm, const char** reason) {
  return guarded([&] {
    if (reason == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "reason must not be NULL");
    *reason = require_handle(comm, "comm")->impl->topology().irregular_reason.c_str();
  });
}

a2a_status_t a2a_comm_cross_check(a2a_comm_t comm, int* on) {
  return guarded([&] {
    if (on == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "on must not be NULL");
    *on = require_handle(comm, "comm")->impl->cross_checks() ? 1 : 0;
  });
}

// Written up to the caller's struct_size: a caller built against an older
// header, with fewer fields, gets those it knows.
a2a_status_t a2a_counters(a2a_comm_t comm, a2a_counters_t* counters) {
  return guarded([&] {
    const size_t first_field = offsetof(a2a_counters_t, calls) + sizeof(int64_t);
    if (counters == nullptr || counters->struct_size < first_field)
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "counters must point to an a2a_counters_t whose struct_size is set "
                "(A2A_COUNTERS_INIT)");
    a2a_counters_t all = A2A_COUNTERS_INIT;
    if (comm == nullptr)
      a2a::process_counters().read(&all);
    else
      require_handle(comm, "comm")->impl->counters().read(&all);
    const size_t struct_size = counters->struct_size;
    std::memcpy(counters, &all, std::min(struct_size, sizeof all));
    counters->struct_size = struct_size;
  });
}

a2a_status_t a2a_all_to_all_workspace_size(a2a_comm_t comm, size_t count, a2a_dtype_t dtype, a2a_algo_t algo,
                                           size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::all_to_all_workspace_size(*require_handle(comm, "comm")->impl, count, dtype, algo);
  });
}

a2a_status_t a2a_all_to_all(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype,
                            a2a_algo_t algo, void* workspace, size_t workspace_bytes) {
  return on_comm(comm, "all_to_all", [&](a2a::Comm& c) {
    a2a::all_to_all(c, send, recv, count, dtype, algo, workspace, workspace_bytes);
  });
}

a2a_status_t a2a_all_to_all_flex_workspace_size(a2a_comm_t comm, const int64_t* shape, int ndim, int split_axis,
                                                int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::all_to_all_flex_workspace_size(*require_handle(comm, "comm")->impl, shape, ndim, split_axis,
                                                 concat_axis, dtype, algo);
  });
}

a2a_status_t a2a_all_to_all_flex(a2a_comm_t comm, const void* send, void* recv, const int64_t* shape, int ndim,
                                 int split_axis, int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo, void* workspace,
                                 size_t workspace_bytes) {
  return on_comm(comm, "all_to_all_flex", [&](a2a::Comm& c) {
    a2a::all_to_all_flex(c, send, recv, shape, ndim, split_axis, concat_axis, dtype, algo, workspace, workspace_bytes);
  });
}

a2a_status_t a2a_v_plan_create(a2a_comm_t comm, const int64_t* send_counts, size_t row_elements, a2a_dtype_t dtype,
                               a2a_algo_t algo, a2a_v_plan_t* plan) {
  if (plan != nullptr) *plan = nullptr;
  return on_comm(comm, "all_to_all_v (count exchange)", [&](a2a::Comm& c) {
    require_out(plan, "plan");
    auto handle = std::make_unique<a2a_v_plan>();
    handle->impl = std::make_unique<a2a::VPlan>(c, send_counts, row_elements, dtype, algo);
    handle->comm = &c;
    *plan = handle.release();
  });
}

a2a_status_t a2a_v_plan_recv_counts(a2a_v_plan_t plan, int64_t* recv_counts) {
  return guarded([&] {
    require_out(recv_counts, "recv_counts");
    const auto& counts = require_handle(plan, "plan")->impl->recv_counts();
    std::memcpy(recv_counts, counts.data(), counts.size() * sizeof(int64_t));
  });
}

a2a_status_t a2a_v_plan_workspace_size(a2a_v_plan_t plan, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = require_handle(plan, "plan")->impl->workspace_bytes();
  });
}

a2a_status_t a2a_all_to_all_v(a2a_v_plan_t plan, const void* send, void* recv, void* workspace,
                              size_t workspace_bytes) {
  return guarded([&] {
    a2a_v_plan& p = *require_handle(plan, "plan");
    // No guard on a communicator that is gone: execute() names the cause.
    std::optional<a2a::CallGuard> guard;
    if (p.impl->comm_exists()) guard.emplace(p.comm->call_gate(), "all_to_all_v", p.comm->rank());
    p.impl->execute(send, recv, workspace, workspace_bytes);
  });
}

a2a_status_t a2a_v_plan_destroy(a2a_v_plan_t plan) {
  return guarded([&] { delete plan; });
}

a2a_status_t a2a_all_to_all_v_start(a2a_comm_t comm, const void* send, const int64_t* send_counts,
                                    size_t row_elements, a2a_dtype_t dtype, a2a_algo_t algo, int64_t* recv_counts,
                                    a2a_v_exchange_t* exchange) {
  if (exchange != nullptr) *exchange = nullptr;
  return on_comm(comm, "all_to_all_v", [&](a2a::Comm& c) {
    require_out(exchange, "exchange");
    require_out(recv_counts, "recv_counts");
    auto handle = std::make_unique<a2a_v_exchange>();
    handle->impl = std::make_unique<a2a::VExchange>(c, send, send_counts, row_elements, dtype, algo);
    handle->comm = &c;
    const auto& counts = handle->impl->recv_counts();
    std::memcpy(recv_counts, counts.data(), counts.size() * sizeof(int64_t));
    *exchange = handle.release();
  });
}

a2a_status_t a2a_v_exchange_workspace_size(a2a_v_exchange_t exchange, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = require_handle(exchange, "exchange")->impl->workspace_bytes();
  });
}

a2a_status_t a2a_all_to_all_v_finish(a2a_v_exchange_t exchange, void* recv, void* workspace,
                                     size_t workspace_bytes) {
  return guarded([&] {
    std::unique_ptr<a2a_v_exchange> owned(require_handle(exchange, "exchange"));
    if (!owned->impl->comm_exists())
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "all_to_all_v: the communicator of this exchange was destroyed before "
                "its finish");
    const a2a::CallGuard guard(owned->comm->call_gate(), "all_to_all_v", owned->comm->rank());
    owned->impl->finish(recv, workspace, workspace_bytes);
  });
}

a2a_status_t a2a_all_to_all_v_drop(a2a_v_exchange_t exchange) {
  return guarded([&] {
    std::unique_ptr<a2a_v_exchange> owned(exchange);
    if (owned && owned->impl && owned->impl->comm_exists()) {
      const a2a::CallGuard guard(owned->comm->call_gate(), "all_to_all_v", owned->comm->rank());
      owned->impl.reset();  // drops the rows
    }
  });
}

a2a_status_t a2a_all_gather(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype) {
  return on_comm(comm, "all_gather", [&](a2a::Comm& c) { a2a::all_gather(c, send, recv, count, dtype); });
}

a2a_status_t a2a_all_reduce(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype,
                            a2a_reduce_op_t op) {
  return on_comm(comm, "all_reduce", [&](a2a::Comm& c) { a2a::all_reduce(c, send, recv, count, dtype, op); });
}

a2a_status_t a2a_reduce_scatter(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype,
                                a2a_reduce_op_t op) {
  return on_comm(comm, "reduce_scatter",
                 [&](a2a::Comm& c) { a2a::reduce_scatter(c, send, recv, count, dtype, op); });
}

a2a_status_t a2a_all_gather_v(a2a_comm_t comm, const void* send, void* recv, const int64_t* counts,
                              a2a_dtype_t dtype) {
  return on_comm(comm, "all_gather_v", [&](a2a::Comm& c) { a2a::all_gather_v(c, send, recv, counts, dtype); });
}

a2a_status_t a2a_reduce_scatter_v(a2a_comm_t comm, const void* send, void* recv, const int64_t* counts,
                                  a2a_dtype_t dtype, a2a_reduce_op_t op) {
  return on_comm(comm, "reduce_scatter_v",
                 [&](a2a::Comm& c) { a2a::reduce_scatter_v(c, send, recv, counts, dtype, op); });
}

a2a_status_t a2a_comm_report_invalid(a2a_comm_t comm, const char* op, const char* message) {
  const char* name = op ? op : "collective";
  return on_comm(comm, name, [&](a2a::Comm& c) { a2a::report_invalid(c, name, message ? message : ""); });
}

a2a_status_t a2a_route_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                      size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::moe::route_workspace_size(exec, num_tokens, top_k, num_experts);
  });
}

a2a_status_t a2a_route(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices, a2a_dtype_t index_dtype,
                       int64_t num_tokens, int64_t top_k, int64_t num_experts, const int64_t* token_order,
                       int64_t capacity, double capacity_setting, void* workspace, size_t workspace_bytes,
                       int64_t* locations, int64_t* counts, int64_t* expert_offsets, a2a_route_info_t* info) {
  return routed(comm, info, [&](a2a::Comm* impl) {
    return a2a::moe::route(exec, impl, indices, index_dtype, num_tokens, top_k, num_experts, token_order, capacity,
                           capacity_setting, workspace, workspace_bytes, locations, counts, expert_offsets);
  });
}

a2a_status_t a2a_route_host_counts(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices,
                                   a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   const int64_t* token_order, int64_t capacity, double capacity_setting,
                                   void* workspace, size_t workspace_bytes, int64_t* locations, int64_t* counts,
                                   int64_t* expert_offsets, int64_t* host_counts, a2a_route_info_t* info) {
  return routed(comm, info, [&](a2a::Comm* impl) {
    return a2a::moe::route(exec, impl, indices, index_dtype, num_tokens, top_k, num_experts, token_order, capacity,
                           capacity_setting, workspace, workspace_bytes, locations, counts, expert_offsets,
                           host_counts, true);
  });
}

a2a_status_t a2a_route_capacities(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices,
                                  a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                  const int64_t* token_order, const int64_t* capacities, void* workspace,
                                  size_t workspace_bytes, int64_t* locations, int64_t* counts,
                                  int64_t* expert_offsets, int64_t* final_capacities, a2a_route_info_t* info) {
  return routed(comm, info, [&](a2a::Comm* impl) {
    return a2a::moe::route_capacities(exec, impl, indices, index_dtype, num_tokens, top_k, num_experts, token_order,
                                      capacities, workspace, workspace_bytes, locations, counts, expert_offsets,
                                      final_capacities);
  });
}

a2a_status_t a2a_route_fixed(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                             int64_t top_k, int64_t num_experts, const int64_t* token_order, int64_t capacity,
                             void* workspace, size_t workspace_bytes, int64_t* locations, int64_t* counts,
                             int64_t* expert_offsets) {
  return guarded([&] {
    a2a::moe::route_fixed(exec, indices, index_dtype, num_tokens, top_k, num_experts, token_order, capacity,
                          workspace, workspace_bytes, locations, counts, expert_offsets);
  });
}

a2a_status_t a2a_route_fixed_dropped(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                     const void* workspace, size_t workspace_bytes, int64_t* num_dropped) {
  return guarded([&] {
    require_out(num_dropped, "num_dropped");
    *num_dropped = a2a::moe::route_fixed_dropped(exec, num_tokens, top_k, num_experts, workspace, workspace_bytes);
  });
}

a2a_status_t a2a_moe_dispatch(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* x, a2a_dtype_t dtype,
                              int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* rows) {
  return guarded([&] { a2a::moe::dispatch(exec, routing, x, dtype, model_dim, gates, gate_dtype, rows); });
}

a2a_status_t a2a_moe_combine(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* rows, a2a_dtype_t dtype,
                             int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* y) {
  return guarded([&] { a2a::moe::combine(exec, routing, rows, dtype, model_dim, gates, gate_dtype, y); });
}

a2a_status_t a2a_moe_gate_grad(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* tokens,
                               const void* rows, a2a_dtype_t dtype, int64_t model_dim, a2a_dtype_t gate_dtype,
                               void* grad_gates) {
  return guarded(
      [&] { a2a::moe::gate_grad(exec, routing, tokens, rows, dtype, model_dim, gate_dtype, grad_gates); });
}

a2a_status_t a2a_top_k_gate_workspace_size(const a2a_top_k_gate_t* gate, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::moe::top_k_gate_workspace_size(gate);
  });
}

a2a_status_t a2a_top_k_gate(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* logits, void* scores,
                            int64_t* indices, void* gates, void* share, void* l_aux, void* workspace) {
  return guarded([&] { a2a::moe::top_k_gate(exec, gate, logits, scores, indices, gates, share, l_aux, workspace); });
}

a2a_status_t a2a_top_k_gate_backward(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* scores,
                                     const int64_t* indices, const void* share, const void* d_gates,
                                     const void* d_l_aux, void* d_logits) {
  return guarded([&] {
    a2a::moe::top_k_gate_backward(exec, gate, scores, indices, share, d_gates, d_l_aux, d_logits);
  });
}

a2a_status_t a2a_fp8_packed_layout(int64_t cols, int64_t block, int64_t* scale_offset, int64_t* row_bytes) {
  return guarded([&] {
    require_out(scale_offset, "scale_offset");
    require_out(row_bytes, "row_bytes");
    const a2a::moe::Fp8Packed layout = a2a::moe::fp8_packed_layout(cols, block);
    *scale_offset = layout.scale_offset;
    *row_bytes = layout.row_bytes;
  });
}

a2a_status_t a2a_quantize_fp8(const a2a_exec_t* exec, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t* out) {
  return guarded([&] { a2a::moe::quantize_fp8(exec, x, dtype, out); });
}

a2a_status_t a2a_dequantize_fp8(const a2a_exec_t* exec, const a2a_fp8_rows_t* in, a2a_dtype_t dtype, void* y) {
  return guarded([&] { a2a::moe::dequantize_fp8(exec, in, dtype, y); });
}

a2a_status_t a2a_low_latency_create(a2a_comm_t comm, const a2a_low_latency_config_t* config,
                                    a2a_low_latency_t* handle) {
  if (handle != nullptr) *handle = nullptr;
  return on_comm(comm, "low_latency_create", [&](a2a::Comm& c) {
    require_out(handle, "handle");
    if (config == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "low_latency_create: config is NULL");
    auto made = std::make_unique<a2a_low_latency>();
    made->impl = std::make_unique<a2a::moe::LowLatency>(c, *config);
    made->comm = &c;
    *handle = made.release();
  });
}

a2a_status_t a2a_low_latency_workspace_size(a2a_low_latency_t handle, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = require_handle(handle, "handle")->impl->layout().workspace_bytes;
  });
}

a2a_status_t a2a_low_latency_expert_capacity(a2a_low_latency_t handle, int64_t* rows) {
  return guarded([&] {
    require_out(rows, "rows");
    *rows = require_handle(handle, "handle")->impl->layout().expert_capacity;
  });
}

a2a_status_t a2a_low_latency_dispatch(a2a_low_latency_t handle, const a2a_exec_t* exec, void* workspace,
                                      size_t workspace_bytes, const void* x, int64_t num_tokens, const void* indices,
                                      a2a_dtype_t index_dtype, void* recv, int64_t* recv_counts) {
  return on_low_latency(handle, "low_latency_dispatch", [&](a2a::moe::LowLatency& ll) {
    ll.dispatch(exec, workspace, workspace_bytes, x, num_tokens, indices, index_dtype, recv, recv_counts);
  });
}

a2a_status_t a2a_low_latency_combine(a2a_low_latency_t handle, const a2a_exec_t* exec, void* workspace,
                                     size_t workspace_bytes, const void* expert_out, const void* gates,
                                     a2a_dtype_t gate_dtype, void* y) {
  return on_low_latency(handle, "low_latency_combine", [&](a2a::moe::LowLatency& ll) {
    ll.combine(exec, workspace, workspace_bytes, expert_out, gates, gate_dtype, y);
  });
}

a2a_status_t a2a_low_latency_check(a2a_low_latency_t handle, const a2a_exec_t* exec, const void* workspace,
                                   size_t workspace_bytes) {
  return on_low_latency(handle, "low_latency_check",
                        [&](a2a::moe::LowLatency& ll) { ll.check(exec, workspace, workspace_bytes); });
}

a2a_status_t a2a_low_latency_destroy(a2a_low_latency_t handle) {
  return guarded([&] { delete handle; });
}

a2a_status_t a2a_es_index_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile,
                                   int64_t* max_slots) {
  return guarded([&] {
    require_out(max_slots, "max_slots");
    *max_slots = a2a::moe::es_index_capacity(num_tokens, top_k, num_experts, tile);
  });
}

a2a_status_t a2a_es_index_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k,
                                         int64_t num_experts, size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::moe::es_index_workspace_size(exec, num_tokens, top_k, num_experts);
  });
}

a2a_status_t a2a_es_index(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                          int64_t top_k, int64_t num_experts, int64_t tile, void* workspace, size_t workspace_bytes,
                          int64_t* slots, int64_t max_slots, int64_t* expert_starts, int64_t* counts,
                          int64_t* num_slots) {
  return guarded([&] {
    require_out(num_slots, "num_slots");
    *num_slots = a2a::moe::es_index(exec, indices, index_dtype, num_tokens, top_k, num_experts, tile, workspace,
                                    workspace_bytes, slots, max_slots, expert_starts, counts);
  });
}

a2a_status_t a2a_esmm_workspace_size(const a2a_es_index_t* index, a2a_es_rows_t y_rows, int64_t n, a2a_dtype_t dtype,
                                     size_t* bytes) {
  return guarded([&] {
    require_out(bytes, "bytes");
    *bytes = a2a::moe::esmm_workspace_size(index, y_rows, n, dtype);
  });
}

a2a_status_t a2a_esmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows,
                      int64_t k, const void* w, a2a_es_weight_layout_t w_layout, const void* bias, const void* gates,
                      a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* y, a2a_es_rows_t y_rows,
                      void* workspace, size_t workspace_bytes) {
  return guarded([&] {
    a2a::moe::esmm(exec, index, x, x_rows, k, w, w_layout, bias, gates, gate_dtype, dtype, n, y, y_rows, workspace,
                   workspace_bytes);
  });
}

a2a_status_t a2a_ess(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows,
                     const void* gates, a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* out) {
  return guarded([&] { a2a::moe::ess(exec, index, x, x_rows, gates, gate_dtype, dtype, n, out); });
}

a2a_status_t a2a_estmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* a, a2a_es_rows_t a_rows,
                       int64_t a_dim, const void* b, a2a_es_rows_t b_rows, int64_t b_dim, const void* gates,
                       a2a_dtype_t gate_dtype, a2a_dtype_t dtype, void* out) {
  return guarded(
      [&] { a2a::moe::estmm(exec, index, a, a_rows, a_dim, b, b_rows, b_dim, gates, gate_dtype, dtype, out); });
}

a2a_status_t a2a_transpose_chunks(const a2a_exec_t* exec, void* dst, const void* src, size_t rows, size_t cols,
                                  size_t chunk_bytes) {
  return guarded([&] {
    size_t bytes = 0;
    if (__builtin_mul_overflow(rows, cols, &bytes) || __builtin_mul_overflow(bytes, chunk_bytes, &bytes))
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "transpose_chunks: ", rows, " x ", cols, " chunks of ", chunk_bytes,
                " bytes overflow the address space");
    if (bytes != 0 && (dst == nullptr || src == nullptr))
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "transpose_chunks: dst or src is NULL but ", bytes, " bytes are to move");
    const char* d = static_cast<const char*>(dst);
    const char* s = static_cast<const char*>(src);
    if (bytes != 0 && d < s + bytes && s < d + bytes)
      a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "transpose_chunks: dst and src overlap");
    a2a::make_device(a2a::read_exec(exec))->transpose_chunks(dst, src, rows, cols, chunk_bytes);
  });
}

a2a_status_t a2a_copy_ranges(const a2a_exec_t* exec, void* dst, const void* src, const a2a_copy_range_t* ranges,
                             size_t count) {
  static_assert(sizeof(a2a_copy_range_t) == sizeof(a2a::CopyRange), "a2a_copy_range_t and CopyRange differ");
  return guarded([&] {
    if (count != 0 && ranges == nullptr) a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "copy_ranges: ranges is NULL");
    for (size_t i = 0; i < count; ++i)
      if (ranges[i].bytes != 0 && (dst == nullptr || src == nullptr))
        a2a::fail(A2A_ERROR_INVALID_ARGUMENT, "copy_ranges: dst or src is NULL but range ", i, " moves ",
                  ranges[i].bytes, " bytes");
    a2a::make_device(a2a::read_exec(exec))
        ->copy_ranges(dst, src, reinterpret_cast<const a2a::CopyRange*>(ranges), count);
  });
}

// Tests only (a2a/a2a_testing.h, not installed).
a2a_status_t a2a_testing_comm_create_mpi(const void* mpi_comm, const a2a_comm_config_t* config, const char* staging,
                                         a2a_comm_t* comm) {
  return create_comm(comm, [&] {
    const MPI_Comm parent = mpi_comm_at(mpi_comm);
    return a2a::create_staged_host_comm(parent, read_config(config), staging);
  });
}

a2a_status_t a2a_testing_comm_create_external_by_round(const a2a_transport_ops_t* ops, int size, int rank,
                                                       const a2a_comm_config_t* config, a2a_comm_t* comm) {
  return create_comm(comm, [&] {
    check_ops(ops, "ops");
    return a2a::create_external_comm(*ops, size, rank, read_config_releasing(config, *ops), false);
  });
}

}  // extern "C"
