// The transport interface: the only thing that differs between MPI and NCCL.
// Algorithms in core/ are written against it once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "a2a/a2a.h"
#include "core/error.hpp"

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

// Where each of blocks packed back to back starts: offsets[r] is the sum of
// sizes[0..r), offsets[sizes.size()] the total (in the sizes' unit).
inline std::vector<size_t> packed_offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t r = 0; r < sizes.size(); ++r) offsets[r + 1] = offsets[r] + sizes[r];
  return offsets;
}

// A set of ranks exchanging with each other: member i is first + i * stride,
// and this rank is member `me`. All ranks (linear), the ranks of one node
// (2DH intra-node phase), or the ranks with one local_rank (2DH inter-node).
struct PeerGroup {
  int first;
  int stride;
  int count;
  int me;
  int member(int i) const { return first + i * stride; }
};

enum class ReduceOp { kSum, kMax, kMin };

// Thrown by a transport's wait that stopped because the posted check
// (Transport::post_check) found a peer outside the predicted call: what the
// wait posted, and the check's messages, are left for settle_disagreement.
class PostedCheckFailed : public Failure {
 public:
  explicit PostedCheckFailed(int member)
      : Failure(A2A_ERROR_MISMATCH, "a peer left the predicted call"), member_(member) {}
  int member() const { return member_; }

 private:
  int member_;
};

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

  // --- Labelled messages: the cross-rank check inside a collective's own
  // messages (Comm::exchange_in_band, docs/algorithms.md "The argument
  // check"). A transport that can label each message with a number and learn
  // the label and size of a peer's next message before receiving it (MPI:
  // the tag, and MPI_Improbe) carries the check in every exchange of a call:
  // each message is labelled with a digest of the call's signature and the
  // exchange's index, and a peer whose next message carries another label, or
  // is a notice (settle_disagreement), disagrees. No message ever meets a
  // shorter buffer than itself. The three operations below stop at the first
  // disagreement and leave what they posted to settle_disagreement, which
  // the caller runs next on every rank.
  virtual bool supports_signed_exchange() const { return false; }
  // One exchange inside `group` (member i is group.member(i)): `pieces`
  // messages to and from every member (self included, zero bytes included),
  // piece k of a pair after piece k - 1, every one labelled `label`; the
  // spans are indexed by member. Receives are posted before the messages
  // come. Returns true when every member's messages carried the label and
  // had the size of their receive; false at the first that did not (its
  // member's index in *disagreeing when given): then the spans may hold what
  // the agreeing members sent. Bounded like group_end.
  virtual bool signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                               const std::function<Span(int, size_t)>& send_piece,
                               const std::function<Span(int, size_t)>& recv_piece, int* disagreeing = nullptr);
  // The exchange over the world whose receivers learn the sizes from the
  // messages (the uneven all-to-all in one round), in two halves. The first
  // posts send_span(r) to every rank r, labelled, and waits (bounded) until
  // the next message of every rank has arrived; nothing is received yet.
  // Returns each one's size in bytes; kOtherLabel marks the first peer whose
  // message had another label, and then the others may be kNotArrived.
  static constexpr int64_t kOtherLabel = -1;
  static constexpr int64_t kNotArrived = -2;
  virtual std::vector<int64_t> signed_start(uint32_t label, const std::function<Span(int)>& send_span);
  // The second half, after a start that found every label equal: receives
  // rank r's message into recv_span(r) where that span has its size, into
  // scratch otherwise (dropped), then waits for the sends.
  virtual void signed_finish(const std::function<Span(int)>& recv_span);
  // Collective: every rank calls it once any labelled operation of the call
  // disagreed on any rank (its own operation returned false, or it rejected
  // its input and ran none). Tells every peer (a notice, which ends a wait
  // for this rank's messages), then receives every message that peers sent
  // here and nothing consumed, and waits for its own sends: the next call
  // starts with no message of this one left anywhere. Bounded like
  // group_end; a timeout or an error leaves the transport unusable.
  virtual void settle_disagreement();

  // --- The posted check: the cross-rank check of a call whose data goes
  // over another transport that returns before the data moved (NCCL), and
  // which every rank predicted alike (Comm's CallPredictor,
  // docs/algorithms.md "The predicted check"). post_check posts one empty
  // message labelled `label` to every member of `group` and the receives of
  // theirs, and returns at once; complete_check waits (bounded) until they
  // completed: true when every member's message carried the label, false at
  // the first that did not (its member's index in *disagreeing), which the
  // caller then settles (settle_disagreement) like a signed exchange's. While
  // one is posted the transport's own waits watch it: where it has disagreed
  // they stop with PostedCheckFailed, since a peer that left the predicted
  // call will never send what they wait for. At most one is posted at a time.
  virtual void post_check(const PeerGroup& group, uint32_t label);
  virtual bool complete_check(int* disagreeing);
  // Whether the check itself works here, without labelled data: post_check,
  // complete_check, settle_disagreement, and signed_exchange of one empty
  // piece over the world (Comm::agree's round). Every transport that labels
  // messages, and the external channel, whose labels travel as messages of
  // their own (external/external_check.cpp).
  virtual bool supports_labelled_check() const { return supports_signed_exchange(); }

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
