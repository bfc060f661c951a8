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

// What a location scan found wrong, kept on the backend by a fixed-capacity
// route (Kernels::locate_fixed) until the host reads it: -1 where nothing.
struct ScanFault {
  int64_t bad_choice = -1;  // the first choice t * k + j whose index is >= num_experts
  int64_t bad_choice_value = 0;
  int64_t bad_order_entry = -1;  // the first token_order entry out of range or repeated
  int64_t bad_order_value = 0;
};

// Throws A2A_ERROR_INVALID_ARGUMENT with the message locate gives for `fault`
// (the token order first, as locate checks it first); returns when there is none.
inline void raise_scan_fault(const ScanFault& fault, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  if (fault.bad_order_entry >= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT,
         route_token_order_message(fault.bad_order_entry, fault.bad_order_value, num_tokens));
  if (fault.bad_choice >= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, route_index_message(fault.bad_choice / top_k, fault.bad_choice % top_k,
                                                         fault.bad_choice_value, num_experts));
}

}  // namespace a2a::moe
