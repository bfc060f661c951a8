// Validated entry points of the fused top-k gate (a2a_top_k_gate,
// a2a_top_k_gate_backward): argument checks, then the backend
// (moe/kernels.hpp). The row logic is moe/gating.hpp's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "a2a/a2a.h"

namespace a2a::moe {

size_t top_k_gate_workspace_size(const a2a_top_k_gate_t* gate);
void top_k_gate(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* logits, void* scores,
                int64_t* indices, void* gates, void* share, void* l_aux, void* workspace);
void top_k_gate_backward(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* scores,
                         const int64_t* indices, const void* share, const void* d_gates, const void* d_l_aux,
                         void* d_logits);

}  // namespace a2a::moe
