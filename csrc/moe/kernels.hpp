// The MoE kernel backend interface: routing (locations and counts), dispatch,
// combine and the gate gradient. The CPU backend is csrc/cpu/moe_cpu.cpp, the
// CUDA one csrc/cuda/moe_cuda.cu; both build their per-element arithmetic from
// moe/elementwise.hpp. The host-side logic around them (argument checks,
// capacity, cross-rank agreement) is written once in moe/moe.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "a2a/a2a.h"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "moe/elementwise.hpp"
#include "moe/fp8.hpp"
#include "moe/messages.hpp"

namespace a2a::moe {

// Input of the location scan. Pointers are in the backend's memory.
struct RouteProblem {
  const void* indices;  // (T, k) int32 or int64; negative = not routed
  a2a_dtype_t index_dtype;
  int64_t num_tokens;  // T
  int64_t top_k;       // k
  int64_t num_experts; // E
  const int64_t* token_order;  // NULL or a permutation of 0..T-1
};

// An operand of the expert-specific operators: (rows, dim) addressed by
// token (row t = c / k of choice c) or by choice (row c).
struct EsOperand {
  const void* data;
  a2a_es_rows_t rows;
  int64_t dim;
};

// Per-choice scales of the expert-specific operators: (T, k) of float32 or
// the data's dtype (is_data), or data == nullptr for a gate of 1.
struct EsGates {
  const void* data;
  bool is_data;
};

// ESMM (a2a_esmm): y (by y_rows, n wide) from x (k = x.dim wide), w of
// layout w_layout (E x n x k, or E x k x n), bias (E, n) or null.
// `workspace` holds T * k * n accumulators (float; double for float64) when
// y is by token and top_k > 1, else may be null.
struct EsMatmul {
  EsOperand x;
  const void* w;
  a2a_es_weight_layout_t w_layout;
  const void* bias;
  EsGates gates;
  a2a_dtype_t dtype;
  int64_t n;
  void* y;
  a2a_es_rows_t y_rows;
  void* workspace;
};

// The wire of the low-latency dispatch and combine (moe/low_latency.cpp):
// per peer one slot of slot_bytes, a LowLatencyHeader and then up to
// slot_rows rows. A dispatch row is the token's row_bytes, zeros to 16, then
// (token, local expert) as two int32; a combine row is model_dim elements of
// dtype, zeros to 16. The workspace holds, each at a 256-byte boundary:
// the send slots (world x slot_bytes), the receive slots (the same), the
// choices (max_tokens x top_k int64: (destination << 32) | row in its slot,
// or -1 when not routed), the arrivals (world x slot_rows int64: the local
// expert x expert_capacity + position in recv of every received row), and a
// status record (LowLatencyStatus) where the CUDA kernels note what the CPU
// throws at once.
struct LowLatencyHeader {
  uint32_t kind;      // kLowLatencyDispatch or kLowLatencyCombine
  uint32_t sequence;  // the handle's call number
  int32_t count;      // rows that follow; -1: the sender rejected its input
  int32_t source;     // the sender's rank
};
constexpr uint32_t kLowLatencyDispatch = 0xa2a1d157u;
constexpr uint32_t kLowLatencyCombine = 0xa2a1c0b1u;

struct LowLatencyLayout {
  int world = 0, rank = 0;
  int64_t max_tokens = 0, top_k = 0, num_experts = 0, local_experts = 0;
  int64_t row_bytes = 0, model_dim = 0;
  a2a_dtype_t dtype = A2A_FLOAT32;
  int64_t dispatch_row = 0, combine_row = 0, slot_rows = 0, slot_bytes = 0, expert_capacity = 0;
  size_t send = 0, recv = 0, choices = 0, arrivals = 0, status = 0, workspace_bytes = 0;
};


// What the CUDA kernels found wrong (the CPU throws instead), each entry the
// offending value plus one, 0 when none (a zeroed workspace is clear).
struct LowLatencyStatus {
  int64_t rejected_by;      // a rank that marked its messages rejected
  int64_t mismatched_from;  // a rank whose message was of another kind or call, or had too many rows
  int64_t bad_choice;       // t * top_k + j of an index >= num_experts (this rank's input)
  int64_t bad_value;        // that index (plus one)
};

// The layout of a (checked) config on `world` ranks, for rank `rank`.
inline LowLatencyLayout low_latency_layout(const a2a_low_latency_config_t& c, int world, int rank) {
  const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };  // fresh lines, CUDA alignment
  LowLatencyLayout l;
  l.world = world;
  l.rank = rank;
  l.max_tokens = c.max_tokens;
  l.top_k = c.top_k;
  l.num_experts = c.num_experts;
  l.local_experts = c.num_experts / world;
  l.row_bytes = c.row_bytes;
  l.model_dim = c.model_dim;
  l.dtype = c.dtype;
  l.dispatch_row = round_up_16(c.row_bytes) + 16;
  l.combine_row = round_up_16(c.model_dim * static_cast<int64_t>(dtype_size(c.dtype)));
  l.slot_rows = c.max_tokens * std::min(c.top_k, l.local_experts);
  l.slot_bytes = static_cast<int64_t>(sizeof(LowLatencyHeader)) + l.slot_rows * std::max(l.dispatch_row, l.combine_row);
  l.expert_capacity = static_cast<int64_t>(world) * c.max_tokens;
  const size_t slots = static_cast<size_t>(world) * static_cast<size_t>(l.slot_bytes);
  l.send = 0;
  l.recv = aligned(slots);
  l.choices = l.recv + aligned(slots);
  l.arrivals = l.choices + aligned(static_cast<size_t>(c.max_tokens * c.top_k) * sizeof(int64_t));
  l.status = l.arrivals + aligned(static_cast<size_t>(world * l.slot_rows) * sizeof(int64_t));
  l.workspace_bytes = l.status + aligned(sizeof(LowLatencyStatus));
  return l;
}

// Calls fn with a value of the storage type of a float dtype (float, double,
// half_t, bfloat16_t): how both backends pick a kernel template.
template <typename Fn>
void with_float_type(const char* op, a2a_dtype_t dtype, Fn&& fn) {
  switch (dtype) {
    case A2A_FLOAT32: return fn(float{});
    case A2A_FLOAT64: return fn(double{});
    case A2A_FLOAT16: return fn(half_t{});
    case A2A_BFLOAT16: return fn(bfloat16_t{});
    default: break;
  }
  fail(A2A_ERROR_INVALID_ARGUMENT, op, ": data dtype ", dtype_name(dtype),
       " is not supported (float32, float64, float16, bfloat16)");
}

// Calls fn with the storage type of a float dtype and the struct of an FP8
// format (moe/fp8.hpp): how both backends pick a quantization kernel.
template <typename Fn>
void with_fp8_types(const char* op, a2a_dtype_t dtype, a2a_fp8_format_t format, Fn&& fn) {
  with_float_type(op, dtype, [&](auto tag) {
    if (format == A2A_FP8_E5M2)
      fn(tag, E5m2{});
    else
      fn(tag, E4m3{});
  });
}

class Kernels {
 public:
  virtual ~Kernels() = default;
  virtual const char* name() const = 0;

  virtual size_t locate_workspace_size(int64_t num_tokens, int64_t top_k, int64_t num_experts) const = 0;

  // The location scan. Walks the T*k choices in Tutel's order (position
  // p = j * T + r is choice j of token t = token_order[r], or r without an
  // order) and gives each routed choice the number of earlier routed choices
  // of the same expert: locations[t * k + j] (-1 when not routed). Returns the
  // per-expert totals ("demand", ignoring any capacity) on the host in
  // `demand` (resized to E). The workspace holds at least
  // locate_workspace_size() bytes (moe/moe.cpp checks). Throws A2A_ERROR_INVALID_ARGUMENT naming the
  // first offending (t, j) when an index is >= E, or when token_order is not
  // a permutation. On CUDA this waits for the stream (bounded), then for its copy of the counts.
  virtual void locate(const RouteProblem& problem, void* workspace, size_t workspace_bytes, int64_t* locations,
                      std::vector<int64_t>& demand) = 0;

  // The location scan at one capacity C > 0 (a2a_route_fixed), without
  // waiting for the device: locations as locate's, and on the backend
  // counts[e] = min(demand[e], C), expert_offsets[e] = e * C (e <= E) and the
  // number dropped, kept in the workspace with what the scan found wrong.
  // C == A2A_CAPACITY_DROPLESS: the packed layout bounded at T*k rows,
  // counts[e] = demand[e], expert_offsets[e] = demand[0] + .. + demand[e-1]
  // (e < E), expert_offsets[E] = T*k (the rows past the routed choices are
  // the last expert's padding), nothing dropped. An
  // index >= E is not routed (location -1); with a bad token_order nothing is
  // (every location -1, every count 0). So the tables are always safe for the
  // kernels, and the error waits for fixed_result.
  virtual void locate_fixed(const RouteProblem& problem, void* workspace, size_t workspace_bytes, int64_t capacity,
                            int64_t* locations, int64_t* counts, int64_t* expert_offsets) = 0;

  // What locate_fixed left in `workspace` (on CUDA after waiting for the
  // stream, bounded): the fault (see messages.hpp) and the number dropped.
  virtual std::pair<ScanFault, int64_t> fixed_result(const void* workspace) = 0;

  // Copies host bytes into the backend's memory (ordered on the stream; the
  // host buffer may be reused when this returns).
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;

  // See a2a_moe_dispatch / a2a_moe_combine / a2a_moe_gate_grad in a2a.h.
  // Arguments are already checked; routing's arrays are in backend memory.
  // gates may be NULL (a gate of 1).
  virtual void dispatch(const a2a_routing_t& routing, const void* x, a2a_dtype_t dtype, int64_t model_dim,
                        const void* gates, a2a_dtype_t gate_dtype, void* rows) = 0;
  virtual void combine(const a2a_routing_t& routing, const void* rows, a2a_dtype_t dtype, int64_t model_dim,
                       const void* gates, a2a_dtype_t gate_dtype, void* y) = 0;
  virtual void gate_grad(const a2a_routing_t& routing, const void* tokens, const void* rows, a2a_dtype_t dtype,
                         int64_t model_dim, a2a_dtype_t gate_dtype, void* grad_gates) = 0;

  // Expert-specific operators (see a2a_es_index / a2a_esmm / a2a_ess /
  // a2a_estmm in a2a.h; moe/es_ops.cpp checks the arguments). The index's
  // arrays are in backend memory.
  //
  // es_scatter_slots: slots[0 .. num_slots) = -1, then for every routed
  // choice c of expert e: slots[expert_starts[e] + locations[c]] = c
  // (locations from locate(), expert_starts in backend memory).
  virtual void es_scatter_slots(const RouteProblem& problem, const int64_t* locations, const int64_t* expert_starts,
                                int64_t num_slots, int64_t* slots) = 0;
  virtual void esmm(const a2a_es_index_t& index, const EsMatmul& problem) = 0;
  virtual void ess(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, a2a_dtype_t dtype,
                   void* out) = 0;
  virtual void estmm(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates,
                     a2a_dtype_t dtype, void* out) = 0;

  // The fused top-k gate (moe/gating.hpp; arguments checked by moe/gating_ops.cpp).
  virtual void top_k_gate(const a2a_top_k_gate_t& gate, const void* logits, void* scores, int64_t* indices,
                          void* gates, void* share, void* l_aux, void* workspace) = 0;
  virtual void top_k_gate_backward(const a2a_top_k_gate_t& gate, const void* scores, const int64_t* indices,
                                   const void* share, const void* d_gates, const void* d_l_aux, void* d_logits) = 0;

  // FP8 rows with block scales (see a2a_quantize_fp8 / a2a_dequantize_fp8
  // in a2a.h; moe/fp8_ops.cpp checks the arguments): x and y are
  // C-contiguous (rows.rows, rows.cols) of dtype; the element logic is
  // moe/fp8.hpp's.
  virtual void quantize_fp8(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows) = 0;
  virtual void dequantize_fp8(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y) = 0;

  // The low-latency dispatch and combine's kernels (the wire above; the
  // exchanges between them are moe/low_latency.cpp's). `workspace` is the
  // caller's, laid out by `l`; every other pointer is backend memory but
  // `sent` and `received`, host arrays of world entries that the CPU fills
  // (the CUDA backend leaves them: its counts stay on the device).
  //
  // low_latency_pack: the send slots of x (num_tokens rows of row_bytes) and
  // indices; the choices table; the headers (kind dispatch, `sequence`, count).
  // A token sends one row per distinct expert of its choices. On the CPU the
  // arguments are checked already (indices < num_experts); on CUDA an index
  // out of range is skipped and noted in the status record.
  virtual void low_latency_pack(const LowLatencyLayout& l, const void* x, int64_t num_tokens, const void* indices,
                                a2a_dtype_t index_dtype, uint32_t sequence, char* workspace, int64_t* sent) = 0;
  // Every send slot's header: count -1 (this rank rejected its input).
  virtual void low_latency_reject(const LowLatencyLayout& l, uint32_t kind, uint32_t sequence, char* workspace) = 0;
  // The receive slots into recv (local experts x expert_capacity rows of
  // row_bytes) and recv_counts (local experts), and the arrivals table,
  // after checking every header (kind dispatch, `sequence`, count in range):
  // the CPU throws (A2A_ERROR_REMOTE naming a rank that rejected, else
  // A2A_ERROR_MISMATCH naming the peer), CUDA notes it in the status record.
  virtual void low_latency_unpack(const LowLatencyLayout& l, uint32_t sequence, char* workspace, void* recv,
                                  int64_t* recv_counts, int64_t* received) = 0;
  // The send slots of the way back: every received row's output, from
  // expert_out (local experts x expert_capacity x model_dim of dtype), in the
  // order it arrived (the dispatch's receive slots give the counts); headers
  // of kind combine.
  virtual void low_latency_return(const LowLatencyLayout& l, const void* expert_out, uint32_t sequence,
                                  char* workspace) = 0;
  // y (num_tokens x model_dim of dtype) from the receive slots of the way
  // back, the choices table and the gates (float32 or dtype; NULL: 1), after
  // checking the headers as low_latency_unpack does (and, given `sent`, that
  // each peer returned as many rows as it was sent).
  virtual void low_latency_combine(const LowLatencyLayout& l, int64_t num_tokens, const void* gates,
                                   a2a_dtype_t gate_dtype, uint32_t sequence, char* workspace, void* y,
                                   const int64_t* sent) = 0;
  // The status record on the host (CUDA: waits for the stream; the CPU's is
  // always clear).
  virtual LowLatencyStatus low_latency_status(const LowLatencyLayout& l, const char* workspace) = 0;
};

// CPU backend with `num_threads` threads (0 = A2A_NUM_THREADS, else all cores).
std::unique_ptr<Kernels> make_cpu_kernels(int num_threads);
// CUDA backend on the calling thread's current device and `stream`
// (a cudaStream_t); its waits for the stream (in route) give up after
// timeout_s. Throws A2A_ERROR_UNSUPPORTED when CUDA was not built in.
std::unique_ptr<Kernels> make_cuda_kernels(void* stream, double timeout_s);

}  // namespace a2a::moe
