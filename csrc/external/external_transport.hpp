// The transport over a caller's own channel (a2a_transport_ops_t): point-to-
// point messages on host memory through the caller's callbacks, for a
// launcher whose channel is all there is (torch.distributed's gloo group
// under torchrun). Every algorithm runs over it unchanged; the dense
// collectives are built here from the same messages:
//
//   allgather(_v)       every rank's block to every other rank, one exchange
//   reduce_scatter(_v)  block r of every rank to rank r, which reduces the W
//                       blocks in rank order (core/elementwise_reduce.hpp)
//   allreduce           a reduce-scatter of W pieces, then an all-gather of
//                       the reduced pieces: 2 (W - 1) / W of the buffer each way
//
// Every element is reduced by one rank in rank order, so every rank holds the
// same bits. Messages to oneself are copies; empty messages are not sent
// (both sides know the sizes: the argument check ran first).
//
// A communicator over the channel has two lanes, two ExternalTransports with
// a tag each: the data lane carries the collectives' messages, the control
// lane the argument check and the small host values (all-to-all-v counts,
// capacities). The channel labels nothing and cannot tell a message's size
// before it is received, so the check travels as headers of its own on the
// control lane (external_check.cpp): a call that every rank predicted posts
// its headers beside the data and completes them before it waits for the
// data (Comm::agree, docs/algorithms.md "The predicted check").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "a2a/a2a.h"
#include "core/transport.hpp"

namespace a2a {

// The caller's callbacks, shared by a communicator and the ones split from
// it; released (ops.release) with the last of them.
class ExternalChannel {
 public:
  explicit ExternalChannel(const a2a_transport_ops_t& ops);
  ~ExternalChannel();
  ExternalChannel(const ExternalChannel&) = delete;
  ExternalChannel& operator=(const ExternalChannel&) = delete;

  const std::string& name() const { return name_; }
  // Each throws a Failure with the callback's status and message.
  int64_t isend(const void* data, size_t bytes, int peer, int tag);
  int64_t irecv(void* data, size_t bytes, int peer, int tag);
  void wait(const std::vector<int64_t>& requests, double timeout_s);

  // Tags: a new communicator takes the largest next tag of its ranks (agreed
  // by its parent), so that two communicators sharing a rank never share a
  // tag; each takes two, one per lane (data: tag, control: tag + 1).
  static constexpr int kTagsPerComm = 2;
  int next_tag() const { return next_tag_; }
  void take_tag(int tag) { next_tag_ = tag + kTagsPerComm; }

 private:
  a2a_transport_ops_t ops_;
  std::string name_;
  int next_tag_ = kTagsPerComm;  // the communicator made from the ops has tags 0 and 1
};

class ExternalTransport final : public Transport {
 public:
  // members[i]: rank i's rank on the channel; this rank is `rank`.
  ExternalTransport(std::shared_ptr<ExternalChannel> channel, std::vector<int> members, int rank, int tag,
                    double timeout_s);
  // A data lane completes the posted check of its communicator's control
  // lane before it waits for its own messages, since a peer that left the
  // predicted call will never send them.
  void watch(ExternalTransport* control) { watched_ = control; }

  const char* name() const override { return channel_->name().c_str(); }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  bool supports_strided() const override { return false; }
  void abort() override { broken_ = true; }

  void group_start() override;
  void send(const Span& span, int peer) override;
  void recv(const Span& span, int peer) override;
  void group_end() override;
  void cancel_group() override;

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override;
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override;
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override;
  void barrier() override;

  // --- The check on the control lane (external_check.cpp). Each check event
  // of a call (its posted check, its round, or a notice where this rank
  // rejected its input) is one header to every peer and one from every peer,
  // so that the lane's messages stay matched in order whatever the ranks
  // called. Labelled data is not supported (supports_signed_exchange false):
  // signed_exchange takes the empty round of Comm::agree only.
  bool supports_labelled_check() const override { return true; }
  bool signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                       const std::function<Span(int, size_t)>& send_piece,
                       const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) override;
  void settle_disagreement() override;
  void post_check(const PeerGroup& group, uint32_t label) override;
  bool complete_check(int* disagreeing) override;
  // Throws PostedCheckFailed where the posted check (completed here first,
  // bounded) found a peer outside the predicted call.
  void complete_posted_before_wait();
  // After the posted check disagreed: whether `peer`'s header carried this
  // rank's label (it predicted the call alike and posted its messages).
  bool posted_agreed_with(int peer) const;

  const std::shared_ptr<ExternalChannel>& channel() const { return channel_; }
  const std::vector<int>& members() const { return members_; }
  double timeout_s() const { return timeout_s_; }

 private:
  void check_usable() const;
  void clear_group();
  // send (sending) or recv: through the channel, or kept for group_end's copy when to oneself.
  void post(const Span& span, int peer, bool sending);

  std::shared_ptr<ExternalChannel> channel_;
  std::vector<int> members_;
  int rank_;
  int tag_;
  double timeout_s_;
  bool broken_ = false;
  // The open group: the channel's requests, and the messages to oneself (the
  // i-th send to oneself is copied into the i-th receive from oneself).
  std::vector<int64_t> requests_;
  std::vector<int> request_peers_;  // the rank of each request
  std::vector<Span> self_sends_;
  std::vector<Span> self_recvs_;
  ExternalTransport* watched_ = nullptr;  // the control lane, on a data lane

  // The check's headers: what this rank sent, what each peer sent.
  struct Header {
    uint32_t label;
    uint32_t kind;  // kLabelled, or kNotice from a rank that rejected its input
  };
  static constexpr uint32_t kLabelled = 1;
  static constexpr uint32_t kNotice = 2;
  static constexpr int kUndecided = -2;
  static constexpr int kAgreed = -1;
  void check_group(const PeerGroup& group) const;
  void post_headers(Header mine);
  // Waits (bounded) for every peer's header: kAgreed, or the first peer
  // whose header differs from {label, kLabelled}.
  int finish_headers(uint32_t label);
  void decide_posted();
  Header header_out_{};
  std::vector<Header> headers_in_;
  std::vector<int64_t> header_requests_;
  bool posted_open_ = false;     // post_check's event, until complete_check or the settle
  uint32_t posted_label_ = 0;
  int posted_verdict_ = kUndecided;
  bool unsettled_ = false;       // an event of this call disagreed: settle_disagreement sends nothing more
};

}  // namespace a2a
