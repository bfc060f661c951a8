// Validated entry points of the expert-specific operators (a2a_es_index,
// a2a_esmm, a2a_ess, a2a_estmm): argument checks and the re-index vector's
// layout on the host; the arithmetic is in the backends (moe/kernels.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "a2a/a2a.h"

namespace a2a::moe {

int64_t es_index_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile);
size_t es_index_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k, int64_t num_experts);
// Returns num_slots.
int64_t es_index(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype, int64_t num_tokens,
                 int64_t top_k, int64_t num_experts, int64_t tile, void* workspace, size_t workspace_bytes,
                 int64_t* slots, int64_t max_slots, int64_t* expert_starts, int64_t* counts);

size_t esmm_workspace_size(const a2a_es_index_t* index, a2a_es_rows_t y_rows, int64_t n, a2a_dtype_t dtype);
void esmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows, int64_t k,
          const void* w, a2a_es_weight_layout_t w_layout, const void* bias, const void* gates, a2a_dtype_t gate_dtype,
          a2a_dtype_t dtype, int64_t n, void* y, a2a_es_rows_t y_rows, void* workspace, size_t workspace_bytes);
void ess(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x, a2a_es_rows_t x_rows, const void* gates,
         a2a_dtype_t gate_dtype, a2a_dtype_t dtype, int64_t n, void* out);
void estmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* a, a2a_es_rows_t a_rows, int64_t a_dim,
           const void* b, a2a_es_rows_t b_rows, int64_t b_dim, const void* gates, a2a_dtype_t gate_dtype,
           a2a_dtype_t dtype, void* out);

}  // namespace a2a::moe
