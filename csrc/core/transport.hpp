// The transport interface: the only thing that differs between MPI and NCCL.
// Algorithms in core/ are written against it once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "a2a/a2a.h"

namespace a2a {

// A message's memory: num_blocks blocks of block_bytes, block i at
// data + i * stride_bytes. One contiguous message is a single block. The
// receiver's Span may be shaped differently from the sender's; only the total
// byte count must agree.
struct Span {
  void* data = nullptr;
  size_t block_bytes = 0;
  size_t num_blocks = 1;
  size_t stride_bytes = 0;

  static Span contiguous(const void* data, size_t bytes) {
    return Span{const_cast<void*>(data), bytes, 1, bytes};
  }
  static Span strided(const void* data, size_t block_bytes, size_t num_blocks, size_t stride_bytes) {
    return Span{const_cast<void*>(data), block_bytes, num_blocks, stride_bytes};
  }
  size_t bytes() const { return block_bytes * num_blocks; }
  bool is_contiguous() const { return num_blocks <= 1 || stride_bytes == block_bytes; }
};

enum class ReduceOp { kSum, kMax, kMin };

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True when send/recv accept non-contiguous Spans; otherwise the algorithms
  // pack layouts with the Device first.
  virtual bool supports_strided() const = 0;
  // Stream-ordered transports (NCCL) enqueue on the stream set here (a
  // cudaStream_t) and return before the data moved; others ignore it.
  virtual void set_stream(void* /*stream*/) {}
  // Whether its operations can be captured into a CUDA graph (they must not
  // wait for the stream). Comm::agree refuses a capture otherwise, on every rank.
  virtual bool supports_capture() const { return true; }
  // Raises an error the transport reported asynchronously (NCCL), if any.
  virtual void check_async_error() {}
  // Called once when the communicator is retired after a failure: releases
  // whatever may still wait for peers (ncclCommAbort).
  virtual void abort() {}

  // Point-to-point group: the sends and receives posted between group_start()
  // and group_end() progress together; group_end() returns when all of them
  // completed (or, on a stream-ordered transport, were enqueued). Sends and
  // receives to oneself are allowed. Waits are bounded by the comm's timeout.
  virtual void group_start() = 0;
  virtual void send(const Span& span, int peer) = 0;
  virtual void recv(const Span& span, int peer) = 0;
  virtual void group_end() = 0;
  // Called instead of group_end() when posting a group failed halfway:
  // drops what was posted (and closes an NCCL group, whose depth is per
  // thread). Must not throw.
  virtual void cancel_group() {}

  // --- Labelled messages (Comm::agree_in_exchange, the uneven all-to-all in
  // one round). A transport that can label each message with a number and
  // learn the label and size of a peer's next message before receiving it
  // (MPI: the tag, and MPI_Improbe) runs a collective's first exchange and
  // its cross-rank argument check as one round, and lets a receiver size
  // its buffers from the messages themselves.
  virtual bool supports_signed_exchange() const { return false; }
  // The first half: posts send_span(i) to every rank i (self included, zero
  // bytes included), labelled with `signature`, and waits (bounded like
  // group_end) until the next message of every rank has arrived, whatever its
  // label. Returns each one's size in bytes, or kOtherLabel where its label
  // differs. Nothing is received yet.
  static constexpr int64_t kOtherLabel = -1;
  virtual std::vector<int64_t> signed_start(uint32_t signature, const std::function<Span(int)>& send_span);
  // The second half: receives rank r's message into recv_span(r) where its
  // label matched and recv_span(r) has its size, and any other message into
  // scratch, dropped (so a longer message never meets a shorter buffer);
  // then waits for the sends. Bounded like group_end.
  virtual void signed_finish(const std::function<Span(int)>& recv_span);
  // The exchange with sizes known to the receiver, as the two halves would
  // run it (receives may be posted before the messages come): returns the
  // ranks whose message had another label or another size than
  // recv_span(rank), whose spans are left as they were; empty when every
  // rank called with the same signature.
  virtual std::vector<int> signed_exchange(uint32_t signature, const std::function<Span(int)>& send_span,
                                           const std::function<Span(int)>& recv_span);

  // Dense collectives, bounded by the same timeout. allgather is also how
  // Comm::agree() checks arguments, so a timeout in it must name the ranks
  // that did not contribute.
  virtual void allgather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Element-wise reductions of `count` elements of dtype (send == recv: in
  // place), and the reduce-scatter of size * count_per_rank elements, rank
  // i keeping block i (out of place). float16 and bfloat16 are reduced in
  // float32 and rounded back at every step, as NCCL does.
  virtual void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) = 0;
  virtual void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                              ReduceOp op) = 0;
  // The uneven forms (MPI_Allgatherv, MPI_Reduce_scatter): rank i's block
  // holds bytes_per_rank[i] bytes (counts[i] elements) and sits at the sum of
  // the blocks before it; allgather_v gathers every block into recv,
  // reduce_scatter_v leaves the reduction of block i in rank i's recv. Every
  // rank passes the same sizes (the caller agreed on them); empty blocks
  // move nothing.
  virtual void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) = 0;
  virtual void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                                ReduceOp op) = 0;
  void allreduce_int64(int64_t* values, size_t count, ReduceOp op) { allreduce(values, values, count, A2A_INT64, op); }
  virtual void barrier() = 0;
};

}  // namespace a2a
