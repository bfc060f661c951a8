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
// (both sides know the sizes: the argument check ran first). The channel
// labels nothing and cannot tell a message's size before it is received, so
// the check is the communicator's own round (Comm::agree).
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
  // by its parent), so that two communicators sharing a rank never share a tag.
  int next_tag() const { return next_tag_; }
  void take_tag(int tag) { next_tag_ = tag + 1; }

 private:
  a2a_transport_ops_t ops_;
  std::string name_;
  int next_tag_ = 1;  // the communicator made from the ops has tag 0
};

class ExternalTransport final : public Transport {
 public:
  // members[i]: rank i's rank on the channel; this rank is `rank`.
  ExternalTransport(std::shared_ptr<ExternalChannel> channel, std::vector<int> members, int rank, int tag,
                    double timeout_s);

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
  std::vector<Span> self_sends_;
  std::vector<Span> self_recvs_;
};

}  // namespace a2a
