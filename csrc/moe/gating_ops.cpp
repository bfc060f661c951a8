#include "moe/gating_ops.hpp"

#include <algorithm>

#include "core/counters.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/arguments.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

// The problem's sizes and dtype; returns the bytes of one element.
size_t check_gate(const char* op, const a2a_top_k_gate_t* gate) {
  require(gate != nullptr, op, ": gate is NULL");
  const a2a_top_k_gate_t& g = *gate;
  require(g.num_tokens >= 0, op, ": num_tokens is ", g.num_tokens);
  require(g.num_experts >= 1, op, ": num_experts is ", g.num_experts, "; a gate needs at least one expert");
  require(g.top_k >= 1 && g.top_k <= g.num_experts, op, ": top_k is ", g.top_k, "; it must be in 1..num_experts (",
          g.num_experts, ")");
  require(is_float(g.dtype), op, ": dtype ", dtype_name(g.dtype),
          " is not supported (float32, float64, float16, bfloat16)");
  // Every byte count below fits in int64: the largest array is (max(T, 1), E) of 8-byte elements (or
  // the workspace's 16 bytes an expert); an E that only a T of 0 hid would wrap the share's size to 0.
  const int64_t elements =
      checked_product(op, std::max<int64_t>(g.num_tokens, 1), g.num_experts, "num_tokens * num_experts");
  checked_product(op, elements, 16, "the gate's bytes");
  return dtype_size(g.dtype);
}

}  // namespace

size_t top_k_gate_workspace_size(const a2a_top_k_gate_t* gate) {
  check_gate("top_k_gate_workspace_size", gate);
  return checked_bytes("top_k_gate_workspace_size", gate->num_experts, 1, sizeof(double) + sizeof(int64_t));
}

void top_k_gate(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* logits, void* scores,
                int64_t* indices, void* gates, void* share, void* l_aux, void* workspace) {
  const char* op = "top_k_gate";
  const size_t element = check_gate(op, gate);
  const a2a_top_k_gate_t& g = *gate;
  require(reinterpret_cast<uintptr_t>(workspace) % 8 == 0, op, ": workspace is not 8-byte aligned");
  Buffers(op)
      .input("logits", logits, checked_bytes(op, g.num_tokens, g.num_experts, element))
      .output("scores", scores, checked_bytes(op, g.num_tokens, g.num_experts, element))
      .output("indices", indices, checked_bytes(op, g.num_tokens, g.top_k, sizeof(int64_t)))
      .output("gates", gates, checked_bytes(op, g.num_tokens, g.top_k, element))
      .output("share", share, checked_bytes(op, 1, g.num_experts, element))
      .output("l_aux", l_aux, element)
      .output("workspace", workspace, top_k_gate_workspace_size(gate));
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->top_k_gate(g, logits, scores, indices, gates, share, l_aux, workspace);
}

void top_k_gate_backward(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* scores,
                         const int64_t* indices, const void* share, const void* d_gates, const void* d_l_aux,
                         void* d_logits) {
  const char* op = "top_k_gate_backward";
  const size_t element = check_gate(op, gate);
  const a2a_top_k_gate_t& g = *gate;
  Buffers buffers(op);
  buffers.input("scores", scores, checked_bytes(op, g.num_tokens, g.num_experts, element))
      .input("indices", indices, checked_bytes(op, g.num_tokens, g.top_k, sizeof(int64_t)))
      .input("share", share, checked_bytes(op, 1, g.num_experts, element))
      .output("d_logits", d_logits, checked_bytes(op, g.num_tokens, g.num_experts, element));
  if (d_gates != nullptr) buffers.input("d_gates", d_gates, checked_bytes(op, g.num_tokens, g.top_k, element));
  if (d_l_aux != nullptr) buffers.input("d_l_aux", d_l_aux, element);
  if (g.num_tokens == 0) return;
  count(nullptr, Count::kKernelCalls);
  make_kernels(exec)->top_k_gate_backward(g, scores, indices, share, d_gates, d_l_aux, d_logits);
}

}  // namespace a2a::moe
