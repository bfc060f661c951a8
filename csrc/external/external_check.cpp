// The argument check over a channel that labels nothing (the control lane of
// a communicator over a2a_transport_ops_t, or beside NCCL).
//
// MPI carries a call's label in its tags and learns a peer's next label by
// probing (cpu/mpi_signed.cpp). The caller's channel can do neither, so the
// label travels as a header of its own, 8 bytes {label, kind}, on the
// control lane's tag. Every check event of a call is one header to every
// peer and one receive of every peer's:
//
//   the posted check   a call that every rank predicted (Comm::agree_predicted):
//                      posted, completed before this rank next waits on
//                      either lane, at its next call, or at comm.check();
//   the round          a call that was not predicted: posted and completed at once;
//   the notice         a rank that rejected its input and made neither
//                      (settle_disagreement), kind kNotice.
//
// Since every rank makes exactly one event per checked call, whatever it
// called, the headers of two ranks always meet in order: a rank in another
// call finds the other label (or a notice) in the header where its own was
// expected, and an event waits for all W - 1 headers before deciding, so
// that no header is left for the next call. A disagreement leaves nothing on
// the control lane (the verdict's all-gather follows on it); what a data lane
// had posted for a predicted call stays behind, and the communicator is
// retired (Comm::gather_verdict), as on NCCL.
#include "core/error.hpp"
#include "external/external_transport.hpp"

namespace a2a {

void ExternalTransport::check_group(const PeerGroup& group) const {
  if (group.first != 0 || group.stride != 1 || group.count != size() || group.me != rank_)
    fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": the ", name(), " transport checks over the whole communicator only");
}

void ExternalTransport::post_headers(Header mine) {
  check_usable();
  if (!header_requests_.empty()) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a check event is still open");
  header_out_ = mine;
  headers_in_.assign(members_.size(), Header{});
  try {
    for (int step = 1; step < size(); ++step) {
      const int from = (rank_ - step + size()) % size();
      header_requests_.push_back(channel_->irecv(&headers_in_[from], sizeof(Header), members_[from], tag_));
    }
    for (int step = 1; step < size(); ++step) {
      const int to = (rank_ + step) % size();
      header_requests_.push_back(channel_->isend(&header_out_, sizeof(Header), members_[to], tag_));
    }
  } catch (const Failure& e) {  // a post failed (gloo: a peer's connection closed, its process died)
    broken_ = true;  // half an event is out: the lane's order is lost
    header_requests_.clear();
    throw Failure(e.status(), cat("rank ", rank_, " of ", size(), ", in the argument check: ", e.what()));
  } catch (...) {
    broken_ = true;
    header_requests_.clear();
    throw;
  }
}

int ExternalTransport::finish_headers(uint32_t label) {
  try {
    channel_->wait(header_requests_, timeout_s_);
  } catch (const Failure& e) {
    broken_ = true;
    header_requests_.clear();
    throw Failure(e.status(), cat("rank ", rank_, " of ", size(), ", in the argument check: ", e.what()));
  }
  header_requests_.clear();
  for (int step = 1; step < size(); ++step) {
    const int from = (rank_ - step + size()) % size();
    if (headers_in_[from].kind != kLabelled || headers_in_[from].label != label) {
      unsettled_ = true;
      return from;
    }
  }
  return kAgreed;
}

bool ExternalTransport::signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                                        const std::function<Span(int, size_t)>& send_piece,
                                        const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) {
  check_group(group);
  for (int member = 0; member < group.count; ++member)
    if (pieces != 1 || send_piece(member, 0).bytes() != 0 || recv_piece(member, 0).bytes() != 0)
      fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": the ", name(), " transport labels empty rounds only");
  if (posted_open_) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a round while a check is posted");
  post_headers(Header{label, kLabelled});
  const int verdict = finish_headers(label);
  if (verdict == kAgreed) return true;
  if (disagreeing != nullptr) *disagreeing = verdict;
  return false;
}

void ExternalTransport::post_check(const PeerGroup& group, uint32_t label) {
  check_group(group);
  if (posted_open_) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a check is posted while another is open");
  post_headers(Header{label, kLabelled});
  posted_open_ = true;
  posted_label_ = label;
  posted_verdict_ = kUndecided;
}

void ExternalTransport::decide_posted() {
  if (posted_verdict_ == kUndecided) posted_verdict_ = finish_headers(posted_label_);
}

bool ExternalTransport::complete_check(int* disagreeing) {
  if (!posted_open_) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": complete_check without a posted check");
  posted_open_ = false;
  decide_posted();
  if (posted_verdict_ == kAgreed) return true;
  if (disagreeing != nullptr) *disagreeing = posted_verdict_;
  return false;
}

void ExternalTransport::complete_posted_before_wait() {
  if (!posted_open_) return;
  decide_posted();
  if (posted_verdict_ != kAgreed) throw PostedCheckFailed(posted_verdict_);
}

bool ExternalTransport::posted_agreed_with(int peer) const {
  return posted_verdict_ != kUndecided && headers_in_[peer].kind == kLabelled &&
         headers_in_[peer].label == posted_label_;
}

void ExternalTransport::settle_disagreement() {
  // The event of this call that disagreed has every header in (its
  // verdict waited for all of them). A rank that rejected its input made
  // none: its notices end the peers' event, and it takes their headers.
  if (posted_open_) {
    posted_open_ = false;
    decide_posted();
  }
  if (!unsettled_) {
    post_headers(Header{0, kNotice});
    finish_headers(0);
  }
  unsettled_ = false;
}

}  // namespace a2a
