// The MPI transport's signed exchanges: messages labelled with the call's
// signature in their MPI tag (Transport::signed_exchange, signed_start,
// signed_finish).
//
// Each peer's first message decides. MPI orders the messages of one sender,
// so ranks that called different collectives, or the same one with other
// arguments, still pair up and learn of it from the tag and the size instead
// of waiting for a message that never comes. And no message ever meets a
// shorter buffer than itself: Open MPI 5 writes a truncated rendezvous
// message past the buffer (found on 2026-11-27, when a receive took any tag:
// a count mismatch of 16000 bytes against 12 corrupted the heap). Two forms:
// - signed_exchange, sizes known: receives posted under the call's tag, the
//   peers whose receive waits probed for a message of another tag;
// - signed_start / signed_finish, sizes unknown (the uneven all-to-all in one
//   round): each peer's message probed (MPI_Improbe) for its tag and size,
//   then received (MPI_Imrecv) into the caller's span where both match, into
//   scratch otherwise; the caller sizes its output between the halves.
#include <algorithm>
#include <deque>

#include "cpu/mpi_transport.hpp"
#include "cpu/mpi_util.hpp"

namespace a2a {

int MpiTransport::signed_tag(uint32_t signature) const {
  return kFirstSignedTag + static_cast<int>(signature % static_cast<uint32_t>(tag_ub_ - kFirstSignedTag + 1));
}

std::vector<int64_t> MpiTransport::signed_start(uint32_t signature, const std::function<Span(int)>& send_span) {
  const int tag = signed_tag(signature);
  drop_arrivals();  // a start whose finish never came (the caller failed between them)
  group_start();
  arrivals_.assign(size_, Arrival{});
  own_send_ = send_span(rank_);
  post_labelled(tag, send_span, nullptr);
  std::vector<int64_t> sizes(size_, 0);
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
        fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": exchange with the argument check failed: recv from rank ",
             from, " (probing its message): ", mpi_error_text(rc));
      }
      if (!flag) continue;
      MPI_Count bytes = 0;
      MPI_Get_elements_x(&status, MPI_BYTE, &bytes);
      arrival.bytes = static_cast<int64_t>(bytes);
      arrival.labelled = status.MPI_TAG == tag;
      sizes[from] = arrival.labelled ? arrival.bytes : kOtherLabel;
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
    fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_,
         " s (A2A_TIMEOUT_S) in the exchange with the argument check; unfinished: ", absent,
         ". Those peers did not call the same collective, died, or are stuck");
  }
  return sizes;
}

void MpiTransport::signed_finish(const std::function<Span(int)>& recv_span) {
  if (arrivals_.empty()) fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": signed_finish without signed_start");
  // A message lands in its span where its label matched and the span has its
  // size; any other lands in dropped_, one after another.
  std::vector<Span> spans(size_);
  auto fits = [&](int peer) {
    return arrivals_[peer].labelled && spans[peer].bytes() == static_cast<size_t>(arrivals_[peer].bytes);
  };
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
  wait_all(requests_, pending_, "exchange with the argument check");
}

// With the sizes known, the receives are posted before the messages come,
// labelled with this call's tag, so that MPI delivers each message straight
// into its span; probing first would leave small messages to MPI's queue of
// unexpected ones (the linear all-to-all measured 1.13-1.37x MPI_Alltoall's
// time at 8-64 KiB that way, against 1.10-1.22x; docs/benchmarks.md). A
// labelled receive matches only a message of the same signature, hence of
// the same size (but for a 32-bit collision, which a truncated receive
// reports). A peer whose next message carries another label is found by
// probing it while its receive waits: that message is received into
// scratch, and the labelled receive cancelled.
std::vector<int> MpiTransport::signed_exchange(uint32_t signature, const std::function<Span(int)>& send_span,
                                               const std::function<Span(int)>& recv_span) {
  const int tag = signed_tag(signature);
  drop_arrivals();
  group_start();
  std::vector<int> mismatched;
  const Span own_send = send_span(rank_), own_recv = recv_span(rank_);
  if (own_send.bytes() == own_recv.bytes())
    copy_span(own_recv, own_send);
  else
    mismatched.push_back(rank_);
  constexpr size_t kNone = SIZE_MAX;
  std::vector<size_t>& receive_of = signed_recv_of_;  // peer -> its labelled receive in requests_
  receive_of.assign(size_, kNone);
  post_labelled(tag, send_span, &recv_span);
  const char* what = "exchange with the argument check";
  std::deque<std::vector<char>> dropped;  // the messages of another label, until they are in
  // Probes the peers whose labelled receive still waits. A message of
  // another label decides only while that receive has not completed: once it
  // has, the probed message is the peer's next call's (MPI delivers one
  // sender's messages in order, so a later message is seen only after the
  // receive of an earlier one completed).
  auto probe_waiting_peers = [&] {
    for (int peer = 0; peer < size_; ++peer) {
      if (receive_of[peer] == kNone) continue;
      MPI_Request& receive = requests_[receive_of[peer]];
      int flag = 0, done = 0;
      MPI_Status status;
      if (receive == MPI_REQUEST_NULL || MPI_Iprobe(peer, MPI_ANY_TAG, comm_, &flag, &status) != MPI_SUCCESS || !flag ||
          status.MPI_TAG == tag)
        continue;
      if (MPI_Request_get_status(receive, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) continue;
      MPI_Message message = MPI_MESSAGE_NULL;
      if (MPI_Improbe(peer, MPI_ANY_TAG, comm_, &flag, &message, &status) != MPI_SUCCESS || !flag) continue;
      MPI_Count bytes = 0;
      MPI_Get_elements_x(&status, MPI_BYTE, &bytes);
      dropped.emplace_back(static_cast<size_t>(bytes));
      post_matched(Span::contiguous(dropped.back().data(), static_cast<size_t>(bytes)), &message, peer);
      pending_.back().dropped = true;
      MPI_Cancel(&requests_[receive_of[peer]]);
      receive_of[peer] = kNone;
      mismatched.push_back(peer);
    }
  };
  std::vector<int>& indices = signed_indices_;
  std::vector<MPI_Status>& statuses = signed_statuses_;
  PollPacer pacer(timeout_s_);
  for (unsigned idle = 1;; ++idle) {
    indices.resize(requests_.size());
    statuses.resize(requests_.size());
    int completed = 0;
    const int rc = MPI_Testsome(static_cast<int>(requests_.size()), requests_.data(), &completed, indices.data(),
                                statuses.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) fail_error(requests_, pending_, what, rc, nullptr);
    if (completed == MPI_UNDEFINED) break;  // every request is MPI_REQUEST_NULL
    for (int k = 0; k < completed; ++k) {
      const size_t i = static_cast<size_t>(indices[k]);
      // A request that completed with an error (a truncated receive) is
      // left allocated by some MPIs (Open MPI), and reported again by every
      // later MPI_Testsome: free it now.
      if (requests_[i] != MPI_REQUEST_NULL) MPI_Request_free(&requests_[i]);
      const MPI_Status& status = statuses[k];
      const int error = rc == MPI_ERR_IN_STATUS ? status.MPI_ERROR : MPI_SUCCESS;
      int error_class = MPI_SUCCESS;
      if (error != MPI_SUCCESS) MPI_Error_class(error, &error_class);
      const bool labelled_recv = pending_[i].kind[0] == 'r' && !pending_[i].dropped;
      if (error != MPI_SUCCESS && !(labelled_recv && error_class == MPI_ERR_TRUNCATE)) {
        const std::string failed = describe(pending_[i]);
        abandon(requests_, pending_);
        fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", what, " failed: ", failed, ": ",
             mpi_error_text(error));
      }
      int cancelled = 0;
      if (labelled_recv) MPI_Test_cancelled(&status, &cancelled);
      if (!labelled_recv || cancelled) continue;
      MPI_Count received = 0;
      MPI_Get_elements_x(&status, MPI_BYTE, &received);
      if (error_class == MPI_ERR_TRUNCATE || received != static_cast<MPI_Count>(pending_[i].bytes))
        mismatched.push_back(pending_[i].peer);  // a collision of labels, with another size
    }
    if (completed != 0) continue;
    if ((idle & 15) == 0) probe_waiting_peers();
    if (!pacer.keep_waiting()) fail_timeout(requests_, pending_, what);
  }
  requests_.clear();
  pending_.clear();
  std::sort(mismatched.begin(), mismatched.end());
  mismatched.erase(std::unique(mismatched.begin(), mismatched.end()), mismatched.end());
  return mismatched;
}

void MpiTransport::post_labelled(int tag, const std::function<Span(int)>& send_span,
                                 const std::function<Span(int)>* recv_span) {
  try {
    for (int step = 1; recv_span != nullptr && step < size_; ++step) {
      const int from = (rank_ - step + size_) % size_;
      signed_recv_of_[from] = requests_.size();
      post((*recv_span)(from), from, false, tag, true);
    }
    for (int step = 1; step < size_; ++step) {
      const int to = (rank_ + step) % size_;
      post(send_span(to), to, true, tag, true);
    }
  } catch (...) {
    abandon(requests_, pending_);
    throw;
  }
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
}

void MpiTransport::drop_arrivals() {
  if (arrivals_.empty()) return;
  std::vector<MPI_Request> requests;
  std::vector<Pending> pending;
  requests.swap(requests_);
  pending.swap(pending_);
  size_t total = 0;
  for (const Arrival& arrival : arrivals_)
    if (arrival.message != MPI_MESSAGE_NULL) total += static_cast<size_t>(arrival.bytes);
  // MPI may still write there after the requests are freed: the buffer stays
  // with this transport, never reused.
  orphans_.emplace_back(total);
  size_t at = 0;
  for (int peer = 0; peer < static_cast<int>(arrivals_.size()); ++peer) {
    Arrival& arrival = arrivals_[peer];
    if (arrival.message == MPI_MESSAGE_NULL) continue;
    try {
      post_matched(Span::contiguous(orphans_.back().data() + at, static_cast<size_t>(arrival.bytes)),
                   &arrival.message, peer);
    } catch (...) {  // nothing more to do for it
    }
    at += static_cast<size_t>(arrival.bytes);
  }
  abandon(requests_, pending_);  // frees the receives just posted
  requests_.swap(requests);
  pending_.swap(pending);
  arrivals_.clear();
}

}  // namespace a2a
