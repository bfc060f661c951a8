// The MPI transport's labelled messages: the cross-rank check inside the
// collectives' own messages (Transport::signed_exchange, signed_start,
// signed_finish, settle_disagreement).
//
// Every message of a checked call carries, in its MPI tag, a digest of the
// call's signature and of the exchange's index in the call. Each peer's first
// message in an exchange decides: MPI orders the messages of one sender, so a
// peer that called another collective, or the same one with other arguments,
// is known by the tag of its first message (or by a notice, kNoticeTag)
// instead of by a message that never comes. And no message ever meets a
// shorter buffer than itself: Open MPI 5 writes a truncated rendezvous
// message past the buffer (found on 2026-11-27, when a receive took any tag:
// a count mismatch of 16000 bytes against 12 corrupted the heap).
//
// A disagreement ends the operation where it is found; what it had posted
// stays open until settle_disagreement, which every rank runs next: a notice
// to every peer (whose wait for this rank ends on it), then an all-to-all of
// how many messages each rank sent each peer since the last settle, then each
// rank receives, into scratch, what was sent to it and not yet taken. So the
// ranks of one call may send in different patterns (2DH's node then rail
// exchanges beside a linear one over the world) and still leave no message
// behind for the next call.
//
// The forms:
// - signed_exchange, sizes known: receives posted under the label, the
//   members whose first receive waits probed for a message of another tag;
// - signed_start / signed_finish, sizes unknown (the uneven all-to-all in one
//   round): each peer's message probed (MPI_Improbe) for its tag and size,
//   then received (MPI_Imrecv) into the caller's span where its size fits,
//   into scratch otherwise; the caller sizes its output between the halves.
#include <algorithm>

#include "cpu/mpi_transport.hpp"
#include "cpu/mpi_util.hpp"

namespace a2a {

namespace {

constexpr const char* kExchange = "exchange with the argument check";
constexpr const char* kSettle = "settling a disagreement of the argument check";
constexpr const char* kPosted = "the posted argument check";

bool is_receive(const char* kind) { return kind[0] == 'r'; }

// The size of a probed or received message.
size_t message_bytes(const MPI_Status& status) {
  MPI_Count bytes = 0;
  MPI_Get_elements_x(&status, MPI_BYTE, &bytes);
  return static_cast<size_t>(bytes);
}

}  // namespace

int MpiTransport::signed_tag(uint32_t label) const {
  return kFirstSignedTag + static_cast<int>(label % static_cast<uint32_t>(tag_ub_ - kFirstSignedTag + 1));
}

void MpiTransport::post_round(const PeerGroup& group, int tag, size_t pieces,
                              const std::function<Span(int, size_t)>& send_piece,
                              const std::function<Span(int, size_t)>& recv_piece, SignedRound& round) {
  drop_arrivals();  // a start whose finish never came (the caller failed between them)
  group_start();
  abandon(round.requests, round.pending);  // what a failure inside its last use left
  round.group = group;
  round.tag = tag;
  round.first_recv_of.assign(group.count, kNoReceive);
  try {
    for (int step = 1; step < group.count; ++step) {
      const int from = (group.me - step + group.count) % group.count;
      round.first_recv_of[from] = requests_.size();
      for (size_t k = 0; k < pieces; ++k) post(recv_piece(from, k), group.member(from), false, tag, true);
    }
    for (int step = 1; step < group.count; ++step) {
      const int to = (group.me + step) % group.count;
      for (size_t k = 0; k < pieces; ++k) post(send_piece(to, k), group.member(to), true, tag, true);
    }
  } catch (...) {
    abandon(requests_, pending_);
    throw;
  }
  // The round's requests move out of the current group (a posted check
  // stays open beside the groups of later operations).
  round.requests.swap(requests_);
  round.pending.swap(pending_);
  requests_.clear();
  pending_.clear();
}

// A member whose first receive still waits is probed: a message of another
// tag decides only while that receive has not completed (MPI delivers one
// sender's messages in order, so a later message is seen only after the
// receive of an earlier one completed). Returns the member, or -1.
int MpiTransport::probe_waiting_members(SignedRound& round) {
  const PeerGroup& group = round.group;
  for (int member = 0; member < group.count; ++member) {
    if (round.first_recv_of[member] == kNoReceive) continue;
    MPI_Request& receive = round.requests[round.first_recv_of[member]];
    const int peer = group.member(member);
    int flag = 0, done = 0;
    MPI_Status status;
    if (receive == MPI_REQUEST_NULL || MPI_Iprobe(peer, MPI_ANY_TAG, comm_, &flag, &status) != MPI_SUCCESS || !flag ||
        status.MPI_TAG == round.tag)
      continue;
    if (MPI_Request_get_status(receive, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) continue;
    MPI_Message message = MPI_MESSAGE_NULL;
    if (MPI_Improbe(peer, MPI_ANY_TAG, comm_, &flag, &message, &status) != MPI_SUCCESS || !flag) continue;
    // Taken into the current group, then left with the round's for the settle.
    post_into_scratch(&message, peer, message_bytes(status));
    round.requests.push_back(requests_.back());
    round.pending.push_back(pending_.back());
    requests_.pop_back();
    pending_.pop_back();
    return member;
  }
  return -1;
}

int MpiTransport::poll_round(SignedRound& round, bool probe, const char* what) {
  std::vector<int>& indices = signed_indices_;
  std::vector<MPI_Status>& statuses = signed_statuses_;
  std::vector<MPI_Request>& requests = round.requests;
  indices.resize(requests.size());
  statuses.resize(requests.size());
  int completed = 0;
  const int rc =
      MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed, indices.data(), statuses.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) fail_error(requests, round.pending, what, rc, nullptr);
  if (completed == MPI_UNDEFINED) {  // every request is MPI_REQUEST_NULL
    requests.clear();
    round.pending.clear();
    return kRoundDone;
  }
  auto member_of = [&](int peer) { return (peer - round.group.first) / round.group.stride; };
  int disagreeing = -1;
  for (int k = 0; k < completed; ++k) {
    const size_t i = static_cast<size_t>(indices[k]);
    // A request that completed with an error (a truncated receive) is left
    // allocated by some MPIs (Open MPI), and reported again by every later
    // MPI_Testsome: free it now.
    if (requests[i] != MPI_REQUEST_NULL) MPI_Request_free(&requests[i]);
    const MPI_Status& status = statuses[k];
    const int error = rc == MPI_ERR_IN_STATUS ? status.MPI_ERROR : MPI_SUCCESS;
    int error_class = MPI_SUCCESS;
    if (error != MPI_SUCCESS) MPI_Error_class(error, &error_class);
    const Pending& pending = round.pending[i];
    const bool labelled_recv = is_receive(pending.kind) && !pending.dropped;
    if (error != MPI_SUCCESS && !(labelled_recv && error_class == MPI_ERR_TRUNCATE)) {
      const std::string failed = describe(pending);
      abandon(requests, round.pending);
      fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", what, " failed: ", failed, ": ",
           mpi_error_text(error));
    }
    // A labelled message of another size: a collision of labels.
    if (labelled_recv && (error_class == MPI_ERR_TRUNCATE || message_bytes(status) != pending.bytes))
      disagreeing = member_of(pending.peer);
  }
  if (disagreeing < 0 && completed == 0 && probe) disagreeing = probe_waiting_members(round);
  if (disagreeing < 0) return completed != 0 ? kRoundProgress : kRoundIdle;
  leave_unsettled(requests, round.pending);
  return disagreeing;
}

int MpiTransport::await_round(SignedRound& round, const char* what) {
  PollPacer pacer(timeout_s_);
  for (unsigned idle = 1;; ++idle) {
    const int state = poll_round(round, (idle & 15) == 0, what);
    if (state == kRoundDone || state >= 0) return state;
    if (state == kRoundProgress) continue;
    if (!pacer.keep_waiting()) fail_timeout(round.requests, round.pending, what);
  }
}

bool MpiTransport::signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                                   const std::function<Span(int, size_t)>& send_piece,
                                   const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) {
  if (pieces == 0) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a signed exchange of no pieces");
  auto disagree = [&](int member) {
    if (disagreeing != nullptr) *disagreeing = member;
    return false;
  };
  for (size_t k = 0; k < pieces; ++k)
    if (send_piece(group.me, k).bytes() != recv_piece(group.me, k).bytes()) {
      drop_arrivals();
      group_start();
      return disagree(group.me);
    }
  for (size_t k = 0; k < pieces; ++k) copy_span(recv_piece(group.me, k), send_piece(group.me, k));
  post_round(group, signed_tag(label), pieces, send_piece, recv_piece, exchange_round_);
  const int state = await_round(exchange_round_, kExchange);
  return state == kRoundDone || disagree(state);
}

void MpiTransport::post_check(const PeerGroup& group, uint32_t label) {
  if (posted_open_) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a check is posted while another is open");
  const Span nothing = Span::contiguous(nullptr, 0);
  auto none = [&](int, size_t) { return nothing; };
  post_round(group, signed_tag(label), 1, none, none, posted_);
  posted_open_ = true;
  posted_state_ = kRoundIdle;
}

int MpiTransport::posted_verdict(bool wait) {
  const bool decided = posted_state_ == kRoundDone || posted_state_ >= 0;
  if (!decided) posted_state_ = wait ? await_round(posted_, kPosted) : poll_round(posted_, true, kPosted);
  return posted_state_;
}

bool MpiTransport::complete_check(int* disagreeing) {
  if (!posted_open_) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": complete_check without a posted check");
  posted_open_ = false;
  const int state = posted_verdict(true);
  if (state == kRoundDone) return true;
  if (disagreeing != nullptr) *disagreeing = state;
  return false;
}

void MpiTransport::complete_posted_before_collective() {
  if (posted_open_ && posted_verdict(true) >= 0) throw PostedCheckFailed(posted_state_);
}

void MpiTransport::watch_posted_check(std::vector<MPI_Request>& requests, std::vector<Pending>& pending) {
  if (!posted_open_ || posted_verdict(false) < 0) return;
  // A peer left the predicted call: what this wait posted may never
  // complete; it is settled with the check's messages.
  leave_unsettled(requests, pending);
  throw PostedCheckFailed(posted_state_);
}

std::vector<int64_t> MpiTransport::signed_start(uint32_t label, const std::function<Span(int)>& send_span) {
  const int tag = signed_tag(label);
  drop_arrivals();
  group_start();
  arrivals_.assign(size_, Arrival{});
  own_send_ = send_span(rank_);
  try {
    for (int step = 1; step < size_; ++step) {
      const int to = (rank_ + step) % size_;
      post(send_span(to), to, true, tag, true);
    }
  } catch (...) {
    abandon(requests_, pending_);
    throw;
  }
  std::vector<int64_t> sizes(size_, kNotArrived);
  sizes[rank_] = static_cast<int64_t>(own_send_.bytes());  // its label is this rank's by definition
  int missing = size_ - 1;
  PollPacer pacer(timeout_s_);
  while (missing > 0) {
    bool found = false;
    // One probe of any source first: where nothing arrived it is one pass of
    // MPI's progress instead of one per peer.
    int anything = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &anything, MPI_STATUS_IGNORE);
    // From me - 1 down, the order in which the peers' sends start.
    for (int step = 1; anything && step < size_; ++step) {
      const int from = (rank_ - step + size_) % size_;
      Arrival& arrival = arrivals_[from];
      if (arrival.message != MPI_MESSAGE_NULL) continue;
      int flag = 0;
      MPI_Status status;
      const int rc = MPI_Improbe(from, MPI_ANY_TAG, comm_, &flag, &arrival.message, &status);
      if (rc != MPI_SUCCESS) {
        arrival.message = MPI_MESSAGE_NULL;
        drop_arrivals();
        abandon(requests_, pending_);
        fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", kExchange, " failed: recv from rank ", from,
             " (probing its message): ", mpi_error_text(rc));
      }
      if (!flag) continue;
      arrival.bytes = static_cast<int64_t>(message_bytes(status));
      arrival.labelled = status.MPI_TAG == tag;
      if (!arrival.labelled) {
        sizes[from] = kOtherLabel;
        leave_unsettled();  // the arrivals wait for settle_disagreement
        return sizes;
      }
      sizes[from] = arrival.bytes;
      --missing;
      found = true;
    }
    if (found || pacer.keep_waiting()) continue;
    std::string absent;  // in the words of fail_timeout's list
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_ && arrivals_[peer].message == MPI_MESSAGE_NULL)
        absent += cat(absent.empty() ? "" : ", ", "recv from rank ", peer, " (size not yet known)");
    drop_arrivals();
    // The sends stay with MPI (abandon): the comm is retired after a timeout.
    abandon(requests_, pending_);
    fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_, " s (A2A_TIMEOUT_S) in the ",
         kExchange, "; unfinished: ", absent, ". Those peers did not call the same collective, died, or are stuck");
  }
  return sizes;
}

void MpiTransport::signed_finish(const std::function<Span(int)>& recv_span) {
  if (arrivals_.empty()) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": signed_finish without signed_start");
  // A message lands in its span where the span has its size; any other
  // lands in dropped_, one after another.
  std::vector<Span> spans(size_);
  auto fits = [&](int peer) { return spans[peer].bytes() == static_cast<size_t>(arrivals_[peer].bytes); };
  size_t dropped_bytes = 0;
  for (int peer = 0; peer < size_; ++peer) {
    spans[peer] = recv_span(peer);
    if (peer != rank_ && !fits(peer)) dropped_bytes += static_cast<size_t>(arrivals_[peer].bytes);
  }
  if (dropped_.size() < dropped_bytes) dropped_.resize(dropped_bytes);
  try {
    size_t at = 0;
    for (int step = 1; step < size_; ++step) {
      const int from = (rank_ - step + size_) % size_;
      Arrival& arrival = arrivals_[from];
      const size_t bytes = static_cast<size_t>(arrival.bytes);
      if (fits(from)) {
        post_matched(spans[from], &arrival.message, from);
      } else {
        post_matched(Span::contiguous(dropped_.data() + at, bytes), &arrival.message, from);
        at += bytes;
      }
    }
  } catch (...) {
    drop_arrivals();
    abandon(requests_, pending_);
    throw;
  }
  arrivals_.clear();
  if (spans[rank_].bytes() == own_send_.bytes()) copy_span(spans[rank_], own_send_);
  wait_all(requests_, pending_, kExchange);
}

void MpiTransport::settle_disagreement() {
  leave_unsettled();
  drop_arrivals(true);
  // A posted check not yet completed (a failure elsewhere ended its call).
  leave_unsettled(posted_.requests, posted_.pending);
  posted_open_ = false;
  // 1. The notices: a peer that still waits for a message of this rank takes
  // this one instead, and knows.
  try {
    for (int step = 1; step < size_; ++step)
      post(Span::contiguous(nullptr, 0), (rank_ + step) % size_, true, kNoticeTag, true);
  } catch (...) {
    abandon(requests_, pending_);
    throw;
  }
  leave_unsettled();
  // 2. Every receive resolved (matched, or cancelled and taken back), so
  // that taken_ is final.
  complete_unsettled(true, kSettle);
  // 3. How many messages each peer sent here.
  std::vector<int64_t> owed(size_, 0);
  MPI_Request request;
  A2A_MPI_CHECK(MPI_Ialltoall(sent_.data(), 1, MPI_INT64_T, owed.data(), 1, MPI_INT64_T, comm_, &request), "rank ",
                rank_, " ", kSettle);
  wait_one(request, kSettle);
  // 4. Those not yet taken, in the order they were sent, into scratch.
  PollPacer pacer(timeout_s_);
  for (;;) {
    std::string owing;
    for (int peer = 0; peer < size_; ++peer) {
      while (peer != rank_ && taken_[peer] < owed[peer]) {
        int flag = 0;
        MPI_Message message = MPI_MESSAGE_NULL;
        MPI_Status status;
        const int rc = MPI_Improbe(peer, MPI_ANY_TAG, comm_, &flag, &message, &status);
        if (rc != MPI_SUCCESS) {
          leave_unsettled();
          abandon(unsettled_, unsettled_pending_);
          fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", kSettle, " failed: recv from rank ", peer,
               " (probing its message): ", mpi_error_text(rc));
        }
        if (!flag) {
          owing += cat(owing.empty() ? "" : ", ", "recv from rank ", peer, " (", owed[peer] - taken_[peer],
                       " message(s))");
          break;
        }
        post_into_scratch(&message, peer, message_bytes(status));
      }
      if (taken_[peer] > owed[peer])
        fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": took ", taken_[peer], " messages from rank ", peer, ", which sent ",
             owed[peer]);
    }
    leave_unsettled();
    if (owing.empty()) break;
    if (!pacer.keep_waiting()) {
      abandon(unsettled_, unsettled_pending_);
      fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_, " s (A2A_TIMEOUT_S) ",
           kSettle, "; unfinished: ", owing, ". Those peers died or are stuck");
    }
  }
  // 5. This rank's sends, taken by now or soon.
  complete_unsettled(false, kSettle);
  std::fill(sent_.begin(), sent_.end(), 0);
  std::fill(taken_.begin(), taken_.end(), 0);
  scratch_.clear();
}

void MpiTransport::leave_unsettled(std::vector<MPI_Request>& requests, std::vector<Pending>& pending) {
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == MPI_REQUEST_NULL) continue;
    if (is_receive(pending[i].kind) && !pending[i].dropped) {
      MPI_Cancel(&requests[i]);
      pending[i].withdrawn = true;
    }
    unsettled_.push_back(requests[i]);
    unsettled_pending_.push_back(pending[i]);
  }
  requests.clear();
  pending.clear();
}

void MpiTransport::complete_unsettled(bool receives_only, const char* what) {
  PollPacer pacer(timeout_s_);
  for (;;) {
    bool open = false;
    for (size_t i = 0; i < unsettled_.size(); ++i) {
      MPI_Request& request = unsettled_[i];
      const Pending& pending = unsettled_pending_[i];
      const bool receive = is_receive(pending.kind);
      if (request == MPI_REQUEST_NULL || (receives_only && !receive)) continue;
      int done = 0;
      MPI_Status status;
      const int rc = MPI_Test(&request, &done, &status);
      if (rc != MPI_SUCCESS) {
        int error_class = MPI_SUCCESS;
        MPI_Error_class(rc, &error_class);
        if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
        if (receive && error_class == MPI_ERR_TRUNCATE) continue;  // it took the message, cut short
        const std::string failed = describe(pending);
        abandon(unsettled_, unsettled_pending_);
        fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", what, " failed: ", failed, ": ",
             mpi_error_text(rc));
      }
      if (!done) {
        open = true;
        continue;
      }
      int cancelled = 0;
      if (pending.withdrawn) MPI_Test_cancelled(&status, &cancelled);
      if (cancelled) --taken_[pending.peer];
    }
    if (!open) break;
    if (!pacer.keep_waiting()) fail_timeout(unsettled_, unsettled_pending_, what);
  }
  if (receives_only) return;
  unsettled_.clear();
  unsettled_pending_.clear();
}

void MpiTransport::post_matched(const Span& span, MPI_Message* message, int peer) {
  const size_t bytes = span.bytes();
  MPI_Request request;
  int rc;
  if (span.is_contiguous() && bytes <= max_count_) {
    rc = MPI_Imrecv(span.data, static_cast<int>(bytes), MPI_BYTE, message, &request);
  } else {
    MPI_Datatype type = span_type(span, max_count_, rank_);
    rc = MPI_Imrecv(span.data, 1, type, message, &request);
    MPI_Type_free(&type);  // released by MPI once the operation completes
  }
  if (rc != MPI_SUCCESS)
    fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": recv from rank ", peer, " (", bytes, " bytes): ",
         mpi_error_text(rc));
  requests_.push_back(request);
  pending_.push_back(Pending{"recv from", peer, bytes});
  ++taken_[peer];
}

void MpiTransport::post_into_scratch(MPI_Message* message, int peer, size_t bytes) {
  scratch_.emplace_back(bytes);  // a moved vector keeps its storage: earlier buffers stay where MPI writes
  post_matched(Span::contiguous(scratch_.back().data(), bytes), message, peer);
  pending_.back().dropped = true;
}

void MpiTransport::drop_arrivals(bool settle) {
  if (arrivals_.empty()) return;
  std::vector<MPI_Request> requests;
  std::vector<Pending> pending;
  requests.swap(requests_);
  pending.swap(pending_);
  for (int peer = 0; peer < static_cast<int>(arrivals_.size()); ++peer) {
    Arrival& arrival = arrivals_[peer];
    if (arrival.message == MPI_MESSAGE_NULL) continue;
    const size_t bytes = static_cast<size_t>(arrival.bytes);
    try {
      if (settle) {
        post_into_scratch(&arrival.message, peer, bytes);
      } else {
        // MPI may still write there after the requests are freed: the buffer
        // stays with this transport, never reused.
        orphans_.emplace_back(bytes);
        post_matched(Span::contiguous(orphans_.back().data(), bytes), &arrival.message, peer);
      }
    } catch (...) {  // nothing more to do for it
    }
  }
  if (settle)
    leave_unsettled();
  else
    abandon(requests_, pending_);  // frees the receives just posted
  requests_.swap(requests);
  pending_.swap(pending);
  arrivals_.clear();
}

}  // namespace a2a
