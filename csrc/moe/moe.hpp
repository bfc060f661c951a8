// Validated entry points of the MoE routing and kernels (a2a_route, a2a_route_capacities,
// a2a_moe_dispatch, a2a_moe_combine, a2a_moe_gate_grad): argument checks, the
// capacity rule and its agreement across ranks. The C ABI is a thin shell
// over these; the arithmetic lives in the backends (moe/kernels.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a::moe {

size_t route_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts);

// comm may be NULL (a local call). With want_host_counts (a2a_route_host_counts),
// host_counts (E, host) gets a copy of counts; NULL then fails like any bad argument.
a2a_route_info_t route(const a2a_exec_t* exec, Comm* comm, const void* indices, a2a_dtype_t index_dtype,
                       int64_t num_tokens, int64_t top_k, int64_t num_experts, const int64_t* token_order,
                       int64_t capacity, double capacity_setting, void* workspace, size_t workspace_bytes,
                       int64_t* locations, int64_t* counts, int64_t* expert_offsets, int64_t* host_counts = nullptr,
                       bool want_host_counts = false);

// a2a_route_capacities: one capacity per expert (host), the ragged layout.
a2a_route_info_t route_capacities(const a2a_exec_t* exec, Comm* comm, const void* indices, a2a_dtype_t index_dtype,
                                  int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                  const int64_t* token_order, const int64_t* capacities, void* workspace,
                                  size_t workspace_bytes, int64_t* locations, int64_t* counts,
                                  int64_t* expert_offsets, int64_t* final_capacities);

// a2a_route_fixed: one capacity, no wait for the device; a2a_route_fixed_dropped
// reads what it kept in the workspace (see a2a.h).
void route_fixed(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                 int64_t top_k, int64_t num_experts, const int64_t* token_order, int64_t capacity, void* workspace,
                 size_t workspace_bytes, int64_t* locations, int64_t* counts, int64_t* expert_offsets);
int64_t route_fixed_dropped(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                            const void* workspace, size_t workspace_bytes);

// The capacity rule of a2a_route for capacity == 0, from the largest
// per-expert demand: see a2a.h.
int64_t capacity_from_setting(double capacity_setting, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              int64_t max_demand);

void dispatch(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* x, a2a_dtype_t dtype,
              int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* rows);
void combine(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* rows, a2a_dtype_t dtype,
             int64_t model_dim, const void* gates, a2a_dtype_t gate_dtype, void* y);
void gate_grad(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* tokens, const void* rows,
               a2a_dtype_t dtype, int64_t model_dim, a2a_dtype_t gate_dtype, void* grad_gates);

}  // namespace a2a::moe
