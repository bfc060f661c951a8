// The low-latency dispatch and combine (a2a_low_latency_*; a2a.h says what
// they compute): a handle per (comm, config), agreed across ranks at
// creation; each call packs its send slots (the backend's kernels), moves one
// message to and one from every rank (the comm's data transport), and
// unpacks (the kernels again). moe/kernels.hpp has the wire.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "a2a/a2a.h"
#include "core/comm.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

class LowLatency {
 public:
  // Collective (Comm::agree on the config).
  LowLatency(Comm& comm, const a2a_low_latency_config_t& config);

  const LowLatencyLayout& layout() const { return layout_; }
  void dispatch(const a2a_exec_t* exec, void* workspace, size_t workspace_bytes, const void* x, int64_t num_tokens,
                const void* indices, a2a_dtype_t index_dtype, void* recv, int64_t* recv_counts);
  void combine(const a2a_exec_t* exec, void* workspace, size_t workspace_bytes, const void* expert_out,
               const void* gates, a2a_dtype_t gate_dtype, void* y);
  void check(const a2a_exec_t* exec, const void* workspace, size_t workspace_bytes);

 private:
  Comm& usable_comm(const char* op) const;
  void require_workspace(const char* op, const Comm& comm, const void* workspace, size_t workspace_bytes) const;
  // One message to and one from every peer, from send slot p into receive
  // slot p: `sent[p]` rows of `row` bytes after the header (moe/low_latency.cpp
  // says how much of a slot travels).
  void exchange(const char* op, char* workspace, bool host, bool rejected, int64_t row,
                const std::vector<int64_t>& sent);

  Comm& comm_;
  std::weak_ptr<const void> comm_lifetime_;
  LowLatencyLayout layout_;
  uint32_t sequence_ = 0;
  // The last dispatch, for its combine: tokens, and (CPU) rows sent to and
  // received from each rank.
  int64_t num_tokens_ = -1;
  std::vector<int64_t> sent_, received_;
};

}  // namespace a2a::moe
