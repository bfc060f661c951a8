// CPU backend of the fused top-k gate; the Kernels overrides of
// cpu/moe_cpu.cpp call these. See a2a_top_k_gate in a2a.h for what they
// compute, moe/gating.hpp for the row logic.
#pragma once

#include <cstdint>

#include "a2a/a2a.h"

namespace a2a::moe {

void top_k_gate_cpu(const a2a_top_k_gate_t& gate, const void* logits, void* scores, int64_t* indices, void* gates,
                    void* share, void* l_aux, void* workspace, int threads);
void top_k_gate_backward_cpu(const a2a_top_k_gate_t& gate, const void* scores, const int64_t* indices,
                             const void* share, const void* d_gates, const void* d_l_aux, void* d_logits,
                             int threads);

}  // namespace a2a::moe
