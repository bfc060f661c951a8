// CPU backend of the low-latency dispatch and combine's kernels (the wire is
// moe/kernels.hpp's): plain loops on one thread, since a call moves a few
// hundred rows at most, in the order the wire fixes, so that the results do
// not depend on anything but the inputs.
#include "cpu/low_latency_cpu.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.hpp"
#include "moe/elementwise.hpp"

namespace a2a::moe {

namespace {

char* slot(const LowLatencyLayout& l, char* workspace, size_t region, int64_t peer) {
  return workspace + region + static_cast<size_t>(peer * l.slot_bytes);
}

LowLatencyHeader* header_of(char* slot_start) { return reinterpret_cast<LowLatencyHeader*>(slot_start); }

char* row_of(char* slot_start, int64_t row, int64_t row_bytes) {
  return slot_start + sizeof(LowLatencyHeader) + static_cast<size_t>(row * row_bytes);
}

int64_t* choices_of(const LowLatencyLayout& l, char* workspace) {
  return reinterpret_cast<int64_t*>(workspace + l.choices);
}

int64_t* arrivals_of(const LowLatencyLayout& l, char* workspace) {
  return reinterpret_cast<int64_t*>(workspace + l.arrivals);
}

// The headers of the receive slots, checked: a rejection names the first
// rank that rejected (A2A_ERROR_REMOTE); a message of another kind, call or
// size names its sender (A2A_ERROR_MISMATCH). Returns the row counts.
void check_headers(const LowLatencyLayout& l, char* workspace, uint32_t kind, uint32_t sequence, const char* op,
                   const int64_t* expected, int64_t* counts) {
  for (int64_t peer = 0; peer < l.world; ++peer) {
    const LowLatencyHeader& h = *header_of(slot(l, workspace, l.recv, peer));
    if (h.kind == kind && h.sequence == sequence && h.source == peer && h.count == -1)
      fail(A2A_ERROR_REMOTE, op, " on rank ", l.rank, " of ", l.world, ": rank(s) ", peer,
           " rejected their input; no rank's results of this call are valid");
  }
  for (int64_t peer = 0; peer < l.world; ++peer) {
    const LowLatencyHeader& h = *header_of(slot(l, workspace, l.recv, peer));
    const bool in_range = h.count >= 0 && h.count <= l.slot_rows && (expected == nullptr || h.count == expected[peer]);
    if (h.kind != kind || h.sequence != sequence || h.source != peer || !in_range)
      fail(A2A_ERROR_MISMATCH, op, " on rank ", l.rank, " of ", l.world, ": the message from rank ", peer,
           " belongs to another call (",
           h.kind == kLowLatencyDispatch ? "a dispatch" : h.kind == kLowLatencyCombine ? "a combine" : "no low-latency call",
           " numbered ", h.sequence, " with ", h.count, " rows, where this rank is at its call ", sequence,
           "): the ranks' low-latency calls are out of step");
    counts[peer] = h.count;
  }
}

void write_headers(const LowLatencyLayout& l, char* workspace, uint32_t kind, uint32_t sequence,
                   const int64_t* counts) {
  for (int64_t peer = 0; peer < l.world; ++peer)
    *header_of(slot(l, workspace, l.send, peer)) =
        LowLatencyHeader{kind, sequence, counts == nullptr ? -1 : static_cast<int32_t>(counts[peer]), l.rank};
}

template <typename T>
void combine_typed(const LowLatencyLayout& l, int64_t num_tokens, const void* gates, bool gate_is_data,
                   char* workspace, T* y) {
  using Acc = typename Num<T>::Acc;
  const int64_t* choices = choices_of(l, workspace);
  std::vector<const void*> rows(static_cast<size_t>(l.top_k));
  std::vector<Acc> weights(static_cast<size_t>(l.top_k));
  for (int64_t t = 0; t < num_tokens; ++t) {
    int64_t kept = 0;
    for (int64_t j = 0; j < l.top_k; ++j) {
      const int64_t c = t * l.top_k + j;
      if (choices[c] < 0) continue;
      weights[kept] = load_gate<T>(gates, gate_is_data, c);
      rows[kept++] = row_of(slot(l, workspace, l.recv, choices[c] >> 32), choices[c] & 0xffffffff, l.combine_row);
    }
    weighted_sum_cpu(l.dtype, y + t * l.model_dim, rows.data(), weights.data(), kept, l.model_dim);
  }
}

}  // namespace

void low_latency_pack_cpu(const LowLatencyLayout& l, const void* x, int64_t num_tokens, const void* indices,
                          a2a_dtype_t index_dtype, uint32_t sequence, char* workspace, int64_t* sent) {
  int64_t* choices = choices_of(l, workspace);
  std::fill(sent, sent + l.world, 0);
  const size_t pad = static_cast<size_t>(l.dispatch_row - 16 - l.row_bytes);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < l.top_k; ++j) {
      const int64_t c = t * l.top_k + j;
      const int64_t expert = load_index(indices, index_dtype, c);
      choices[c] = -1;
      if (expert < 0) continue;
      const int64_t earlier = earlier_same_expert(indices, index_dtype, t, j, l.top_k, expert);
      if (earlier >= 0) {
        choices[c] = choices[earlier];
        continue;
      }
      const int64_t peer = expert / l.local_experts;
      const int64_t row = sent[peer]++;
      char* out = row_of(slot(l, workspace, l.send, peer), row, l.dispatch_row);
      std::memcpy(out, static_cast<const char*>(x) + t * l.row_bytes, static_cast<size_t>(l.row_bytes));
      std::memset(out + l.row_bytes, 0, pad);
      const int32_t meta[4] = {static_cast<int32_t>(t), static_cast<int32_t>(expert % l.local_experts), 0, 0};
      std::memcpy(out + l.dispatch_row - 16, meta, sizeof meta);
      choices[c] = (peer << 32) | row;
    }
  }
  write_headers(l, workspace, kLowLatencyDispatch, sequence, sent);
}

void low_latency_reject_cpu(const LowLatencyLayout& l, uint32_t kind, uint32_t sequence, char* workspace) {
  write_headers(l, workspace, kind, sequence, nullptr);
}

void low_latency_unpack_cpu(const LowLatencyLayout& l, uint32_t sequence, char* workspace, void* recv,
                            int64_t* recv_counts, int64_t* received) {
  check_headers(l, workspace, kLowLatencyDispatch, sequence, "low_latency_dispatch", nullptr, received);
  int64_t* arrivals = arrivals_of(l, workspace);
  std::fill(recv_counts, recv_counts + l.local_experts, 0);
  for (int64_t peer = 0; peer < l.world; ++peer) {
    char* source = slot(l, workspace, l.recv, peer);
    for (int64_t i = 0; i < received[peer]; ++i) {
      const char* in = row_of(source, i, l.dispatch_row);
      int32_t meta[2];
      std::memcpy(meta, in + l.dispatch_row - 16, sizeof meta);
      if (meta[1] < 0 || meta[1] >= l.local_experts || meta[0] < 0 || meta[0] >= l.max_tokens)
        fail(A2A_ERROR_MISMATCH, "low_latency_dispatch on rank ", l.rank, " of ", l.world, ": row ", i,
             " from rank ", peer, " names local expert ", meta[1], " and token ", meta[0],
             ", beyond this handle's (the ranks' handles differ)");
      const int64_t position = recv_counts[meta[1]]++;
      const int64_t at = meta[1] * l.expert_capacity + position;
      std::memcpy(static_cast<char*>(recv) + at * l.row_bytes, in, static_cast<size_t>(l.row_bytes));
      arrivals[peer * l.slot_rows + i] = at;
    }
  }
}

void low_latency_return_cpu(const LowLatencyLayout& l, const void* expert_out, uint32_t sequence, char* workspace) {
  const int64_t* arrivals = arrivals_of(l, workspace);
  const size_t row = static_cast<size_t>(l.model_dim) * dtype_size(l.dtype);
  std::vector<int64_t> received(static_cast<size_t>(l.world));
  for (int64_t peer = 0; peer < l.world; ++peer)  // the dispatch's receive slots, checked by its unpack
    received[peer] = header_of(slot(l, workspace, l.recv, peer))->count;
  for (int64_t peer = 0; peer < l.world; ++peer) {
    char* out = slot(l, workspace, l.send, peer);
    for (int64_t i = 0; i < received[peer]; ++i) {
      char* dst = row_of(out, i, l.combine_row);
      std::memcpy(dst, static_cast<const char*>(expert_out) + arrivals[peer * l.slot_rows + i] * row, row);
      std::memset(dst + row, 0, static_cast<size_t>(l.combine_row) - row);
    }
  }
  write_headers(l, workspace, kLowLatencyCombine, sequence, received.data());
}

void low_latency_combine_cpu(const LowLatencyLayout& l, int64_t num_tokens, const void* gates, a2a_dtype_t gate_dtype,
                             uint32_t sequence, char* workspace, void* y, const int64_t* sent) {
  std::vector<int64_t> counts(static_cast<size_t>(l.world));
  check_headers(l, workspace, kLowLatencyCombine, sequence, "low_latency_combine", sent, counts.data());
  with_float_type("low_latency_combine", l.dtype, [&](auto tag) {
    using T = decltype(tag);
    combine_typed<T>(l, num_tokens, gates, gates != nullptr && gate_dtype == l.dtype, workspace, static_cast<T*>(y));
  });
}

}  // namespace a2a::moe
