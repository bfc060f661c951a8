#include "external/external_transport.hpp"

#include <cstring>
#include <utility>

#include "core/dtype.hpp"
#include "core/elementwise_reduce.hpp"
#include "core/error.hpp"

namespace a2a {

namespace {

constexpr size_t kErrorBytes = 1024;

// A callback's status as a Failure; its message, or a generic one.
void raise_callback(int status, const char* error, const std::string& name, const char* callback) {
  if (status == A2A_SUCCESS) return;
  const auto code = static_cast<a2a_status_t>(status);
  const bool known = status > A2A_SUCCESS && status <= A2A_ERROR_INTERNAL;
  fail(known ? code : A2A_ERROR_TRANSPORT, "the ", name, " transport's ", callback, ": ",
       error[0] != '\0' ? error : a2a_status_string(known ? code : A2A_ERROR_TRANSPORT));
}

}  // namespace

ExternalChannel::ExternalChannel(const a2a_transport_ops_t& ops) : ops_(ops), name_(ops.name ? ops.name : "external") {}

ExternalChannel::~ExternalChannel() {
  if (ops_.release != nullptr) ops_.release(ops_.user);
}

int64_t ExternalChannel::isend(const void* data, size_t bytes, int peer, int tag) {
  char error[kErrorBytes] = {0};
  int64_t request = -1;
  raise_callback(ops_.isend(ops_.user, data, bytes, peer, tag, &request, error, kErrorBytes), error, name_, "isend");
  return request;
}

int64_t ExternalChannel::irecv(void* data, size_t bytes, int peer, int tag) {
  char error[kErrorBytes] = {0};
  int64_t request = -1;
  raise_callback(ops_.irecv(ops_.user, data, bytes, peer, tag, &request, error, kErrorBytes), error, name_, "irecv");
  return request;
}

void ExternalChannel::wait(const std::vector<int64_t>& requests, double timeout_s) {
  if (requests.empty()) return;
  char error[kErrorBytes] = {0};
  raise_callback(ops_.wait(ops_.user, requests.data(), requests.size(), timeout_s, error, kErrorBytes), error, name_,
                 "wait");
}

ExternalTransport::ExternalTransport(std::shared_ptr<ExternalChannel> channel, std::vector<int> members, int rank,
                                     int tag, double timeout_s)
    : channel_(std::move(channel)), members_(std::move(members)), rank_(rank), tag_(tag), timeout_s_(timeout_s) {}

void ExternalTransport::check_usable() const {
  if (broken_)
    fail(A2A_ERROR_TRANSPORT, "rank ", rank_, ": the ", name(), " transport failed earlier (a message may still be in "
         "flight); create a new communicator");
}

void ExternalTransport::group_start() {
  check_usable();
  // On the control lane nothing may follow a posted check's headers before
  // they are in: a peer that left the predicted call settles and gathers the
  // verdict here next, and must meet no message of this rank's call.
  complete_posted_before_wait();
  clear_group();
}

void ExternalTransport::clear_group() {
  requests_.clear();
  request_peers_.clear();
  self_sends_.clear();
  self_recvs_.clear();
}

void ExternalTransport::send(const Span& span, int peer) { post(span, peer, true); }

void ExternalTransport::recv(const Span& span, int peer) { post(span, peer, false); }

void ExternalTransport::post(const Span& span, int peer, bool sending) {
  if (peer < 0 || peer >= size())
    fail(A2A_ERROR_INTERNAL, sending ? "send to" : "receive from", " rank ", peer, " of ", size());
  if (!span.is_contiguous()) fail(A2A_ERROR_INTERNAL, "the ", name(), " transport takes contiguous messages only");
  if (peer == rank_)
    (sending ? self_sends_ : self_recvs_).push_back(span);
  else if (span.bytes() != 0) {
    try {
      requests_.push_back(sending ? channel_->isend(span.data, span.bytes(), members_[peer], tag_)
                                  : channel_->irecv(span.data, span.bytes(), members_[peer], tag_));
    } catch (const Failure& e) {
      // A peer that died can fail the post itself (gloo: the connection is
      // closed): named as group_end names a failed wait, and this group's
      // posted messages stay in the channel, so no next call may meet them.
      broken_ = true;
      throw Failure(e.status(), cat("rank ", rank_, " of ", size(), ": ", e.what()));
    }
    request_peers_.push_back(peer);
  }
}

void ExternalTransport::group_end() {
  try {
    if (self_sends_.size() != self_recvs_.size())
      fail(A2A_ERROR_INTERNAL, "rank ", rank_, " sent ", self_sends_.size(), " message(s) to itself and received ",
           self_recvs_.size());
    for (size_t i = 0; i < self_sends_.size(); ++i) {
      if (self_sends_[i].bytes() != self_recvs_[i].bytes())
        fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a message of ", self_sends_[i].bytes(), " bytes to itself met a "
             "receive of ", self_recvs_[i].bytes());
      if (self_sends_[i].bytes() != 0) std::memmove(self_recvs_[i].data, self_sends_[i].data, self_sends_[i].bytes());
    }
    // At the call's first exchange, whether or not it moves anything of this
    // rank's: every rank that posted then stops at the same exchange, so that
    // the agreeing peers' messages waited for below were posted by them too
    // (a rank whose first 2DH phase is empty would otherwise stop at the
    // second, waiting for a peer that stopped at the first).
    if (watched_ != nullptr) watched_->complete_posted_before_wait();
    channel_->wait(requests_, timeout_s_);
  } catch (const PostedCheckFailed&) {
    // The peers that predicted the call alike posted its messages too, and
    // the channel moves them whenever they meet: they must complete before
    // the call's buffers go back to the caller. A peer that left posted
    // none, so what this rank posted to it never moves.
    std::vector<int64_t> agreeing;
    for (size_t i = 0; i < requests_.size(); ++i)
      if (watched_->posted_agreed_with(request_peers_[i])) agreeing.push_back(requests_[i]);
    try {
      channel_->wait(agreeing, timeout_s_);
    } catch (...) {
    }
    broken_ = true;  // the channel keeps the rest: no next call may meet it
    throw;
  } catch (const Failure& e) {
    broken_ = true;  // what the channel still holds may arrive later: no next call may meet it
    throw Failure(e.status(), cat("rank ", rank_, " of ", size(), ": ", e.what()));
  } catch (...) {
    broken_ = true;
    throw;
  }
  clear_group();
}

void ExternalTransport::cancel_group() {
  // The channel cannot take back a posted message; wait (bounded) for what
  // was posted, so that none is left for the next call.
  try {
    channel_->wait(requests_, timeout_s_);
  } catch (...) {
    broken_ = true;
  }
  clear_group();
}

void ExternalTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  allgather_v(send, recv, std::vector<size_t>(members_.size(), bytes_per_rank));
}

void ExternalTransport::allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) {
  const std::vector<size_t> offsets = packed_offsets(bytes_per_rank);
  auto* out = static_cast<char*>(recv);
  group_start();
  for (int peer = 0; peer < size(); ++peer) {
    this->send(Span::contiguous(send, bytes_per_rank[rank_]), peer);
    this->recv(Span::contiguous(out + offsets[peer], bytes_per_rank[peer]), peer);
  }
  group_end();
}

void ExternalTransport::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts,
                                         a2a_dtype_t dtype, ReduceOp op) {
  const size_t item = dtype_size(dtype);
  const std::vector<size_t> offsets = packed_offsets(counts);
  const size_t mine = counts[rank_] * item;
  std::vector<char> blocks(mine * members_.size());  // every rank's copy of this rank's block, in rank order
  group_start();
  for (int peer = 0; peer < size(); ++peer) {
    this->send(Span::contiguous(static_cast<const char*>(send) + offsets[peer] * item, counts[peer] * item), peer);
    this->recv(Span::contiguous(blocks.data() + mine * peer, mine), peer);
  }
  group_end();
  if (mine == 0) return;
  std::memcpy(recv, blocks.data(), mine);
  for (int peer = 1; peer < size(); ++peer) reduce_into(recv, blocks.data() + mine * peer, counts[rank_], dtype, op);
}

void ExternalTransport::reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                                       ReduceOp op) {
  reduce_scatter_v(send, recv, std::vector<size_t>(members_.size(), count_per_rank), dtype, op);
}

void ExternalTransport::allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  // W pieces, the first count % W one element longer; piece r is reduced by rank r.
  const size_t W = members_.size();
  std::vector<size_t> pieces(W, count / W);
  for (size_t r = 0; r < count % W; ++r) ++pieces[r];
  const size_t item = dtype_size(dtype);
  std::vector<char> reduced(pieces[rank_] * item);
  reduce_scatter_v(send, reduced.data(), pieces, dtype, op);  // reads send before recv is written (in place)
  std::vector<size_t> bytes(W);
  for (size_t r = 0; r < W; ++r) bytes[r] = pieces[r] * item;
  allgather_v(reduced.data(), recv, bytes);
}

void ExternalTransport::barrier() {
  const char mine = 0;
  std::vector<char> all(members_.size());
  allgather(&mine, all.data(), 1);
}

}  // namespace a2a
