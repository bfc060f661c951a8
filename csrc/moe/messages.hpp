// Error texts of the location scan, shared by the CPU and CUDA backends so
// that both report a bad input in the same words.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.hpp"

namespace a2a::moe {

// indices[token, choice] holds `value`, which is >= num_experts.
inline std::string route_index_message(int64_t token, int64_t choice, int64_t value, int64_t num_experts) {
  return cat("route: indices[", token, ", ", choice, "] = ", value, " is out of range for num_experts ", num_experts,
             " (valid: 0..", num_experts - 1, ", or negative for a choice that is not routed)");
}

// token_order[rank] holds `value`, which is out of 0..num_tokens-1 or repeats
// an earlier entry.
inline std::string route_token_order_message(int64_t rank, int64_t value, int64_t num_tokens) {
  return cat("route: token_order[", rank, "] = ", value, " is not a permutation of 0..", num_tokens - 1,
             " (out of range or repeated)");
}

}  // namespace a2a::moe
