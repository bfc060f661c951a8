// CPU backend of the expert-specific operators (ESMM, ESS, ESTMM and the
// re-index vector's scatter); the Kernels overrides of cpu/moe_cpu.cpp call
// these. See a2a_esmm / a2a_ess / a2a_estmm in a2a.h for what they compute.
#pragma once

#include <cstdint>

#include "moe/kernels.hpp"

namespace a2a::moe {

void es_scatter_slots_cpu(const RouteProblem& problem, const int64_t* locations, const int64_t* expert_starts,
                          int64_t num_slots, int64_t* slots);
void esmm_cpu(const a2a_es_index_t& index, const EsMatmul& problem, int threads);
void ess_cpu(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, a2a_dtype_t dtype, void* out,
             int threads);
void estmm_cpu(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates,
               a2a_dtype_t dtype, void* out, int threads);

}  // namespace a2a::moe
