// Transport over MPI: nonblocking Isend/Irecv completed by a bounded wait.
// Strided spans and messages of 2^31 bytes or more travel as derived
// datatypes, so nothing is packed by hand and MPI's int counts never overflow.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "core/topology.hpp"
#include "core/transport.hpp"

namespace a2a {

// INT_MAX, or less from A2A_MPI_MAX_COUNT (an integer in [1, INT_MAX]) so that
// tests reach the large-message path with small buffers.
size_t max_int_count();

class MpiTransport final : public Transport {
 public:
  // Takes ownership of `comm` (a duplicate made for this transport).
  // max_count: the largest byte count passed to MPI as a plain int.
  MpiTransport(MPI_Comm comm, double timeout_s, size_t max_count);
  ~MpiTransport() override;

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool supports_strided() const override { return true; }

  void group_start() override;
  void send(const Span& span, int peer) override;
  void recv(const Span& span, int peer) override;
  void group_end() override;
  void cancel_group() override {
    abandon(requests_, pending_);
    own_sends_.clear();
    own_recvs_.clear();
  }
  bool supports_signed_exchange() const override { return true; }
  // In mpi_signed.cpp.
  bool signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                       const std::function<Span(int, size_t)>& send_piece,
                       const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) override;
  std::vector<int64_t> signed_start(uint32_t label, const std::function<Span(int)>& send_span) override;
  void signed_finish(const std::function<Span(int)>& recv_span) override;
  void settle_disagreement() override;
  void post_check(const PeerGroup& group, uint32_t label) override;
  bool complete_check(int* disagreeing) override;

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override;
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override;
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override;
  void barrier() override;

  MPI_Comm mpi_comm() const { return comm_; }

 private:
  struct Pending {
    const char* kind;  // "send to" / "recv from"
    int peer;
    size_t bytes;
    bool dropped = false;    // a receive of a message of another label, into scratch (the signed exchange)
    bool withdrawn = false;  // a labelled receive cancelled after a disagreement: it may still have matched
  };
  // even_if_empty: post a zero-byte message too (the signed exchange, whose
  // sizes are not yet known to agree).
  void post(const Span& span, int peer, bool is_send, int tag, bool even_if_empty = false);
  // Waits for `requests` with the timeout; on expiry abandons them and throws
  // A2A_ERROR_TIMEOUT listing the unfinished operations.
  // While a check is posted it watches that check (watch_posted_check);
  // not a nonblocking collective's wait (`watch` false), whose request can
  // be neither cancelled nor settled.
  void wait_all(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what,
                bool watch = true);
  // Throws A2A_ERROR_TIMEOUT naming the requests still open, after abandoning them.
  [[noreturn]] void fail_timeout(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what);
  // "recv from rank 3 (16384 bytes)"; a nonblocking collective has no peer.
  static std::string describe(const Pending& pending);
  // After a wait returned the MPI error `rc` (a peer's process failed, its connection closed): throws
  // A2A_ERROR_TRANSPORT naming the requests that failed (from `statuses`, the wait's, when rc is
  // MPI_ERR_IN_STATUS) and those still open, after abandoning them.
  [[noreturn]] void fail_error(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what,
                               int rc, const MPI_Status* statuses);
  // Waits for one nonblocking-collective request (allreduce, barrier).
  void wait_one(MPI_Request request, const char* what);
  // Cancels unmatched receives and frees the point-to-point requests;
  // nonblocking-collective requests are dropped unfreed (MPI forbids it).
  static void abandon(std::vector<MPI_Request>& requests, std::vector<Pending>& pending);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_;
  int tag_ub_ = 32767;  // MPI_TAG_UB
  size_t max_count_;  // largest count passed to MPI as a plain int (A2A_MPI_MAX_COUNT for tests)
  static void copy_span(const Span& dst, const Span& src);
  std::vector<MPI_Request> requests_;  // the current point-to-point group
  std::vector<Pending> pending_;
  std::vector<MPI_Status> wait_statuses_;  // wait_all's: they alone say which request failed
  std::vector<Span> own_sends_, own_recvs_;  // the group's messages to this rank, copied at group_end
  // The signed exchange between its halves: each peer's next message, found
  // by MPI_Improbe and not yet received, and this rank's own.
  struct Arrival {
    MPI_Message message = MPI_MESSAGE_NULL;
    int64_t bytes = 0;
    bool labelled = false;  // it carries this call's label
  };
  std::vector<Arrival> arrivals_;
  Span own_send_;
  std::vector<char> dropped_;  // signed_finish's: where messages of another size are received
  // signed_exchange's per-call tables, kept to spare allocations.
  std::vector<int> signed_indices_;
  std::vector<MPI_Status> signed_statuses_;
  // A labelled round in flight: signed_exchange's, or the posted check's.
  struct SignedRound {
    PeerGroup group{0, 1, 0, 0};
    int tag = 0;
    std::vector<MPI_Request> requests;
    std::vector<Pending> pending;
    std::vector<size_t> first_recv_of;  // member -> index in requests of the receive of its first piece
  };
  static constexpr size_t kNoReceive = SIZE_MAX;
  // poll_round's verdicts besides a disagreeing member (>= 0).
  static constexpr int kRoundDone = -1;      // every message came, labelled and of its size
  static constexpr int kRoundProgress = -2;  // some completed
  static constexpr int kRoundIdle = -3;      // none did
  SignedRound exchange_round_, posted_;
  bool posted_open_ = false;  // post_check's round, until complete_check
  int posted_state_ = kRoundIdle;  // its verdict once a watching wait found one
  // The posted check's verdict: kRoundDone or a disagreeing member once
  // decided (awaited when `wait`, else looked at once), kRoundProgress or
  // kRoundIdle while not.
  int posted_verdict(bool wait);
  // Posts the round's receives, then its sends, into `round`.
  void post_round(const PeerGroup& group, int tag, size_t pieces, const std::function<Span(int, size_t)>& send_piece,
                  const std::function<Span(int, size_t)>& recv_piece, SignedRound& round);
  // One look at the round (probing the members whose first receive waits
  // when `probe`): kRoundDone, kRoundProgress, kRoundIdle, or the first
  // disagreeing member, whose round's open requests are then left unsettled.
  int poll_round(SignedRound& round, bool probe, const char* what);
  // Polls until done or a disagreement (bounded): kRoundDone or the member.
  int await_round(SignedRound& round, const char* what);
  int probe_waiting_members(SignedRound& round);
  // Called by the waits while a posted check is open: throws
  // PostedCheckFailed, leaving `requests` unsettled, once it has disagreed.
  void watch_posted_check(std::vector<MPI_Request>& requests, std::vector<Pending>& pending);
  // Called before an MPI collective (whose wait cannot watch: its request can
  // be neither cancelled nor settled, and a settle's own collective must not
  // meet it): completes a posted check, throwing PostedCheckFailed where it
  // disagreed, so that no rank enters the collective that a peer left.
  void complete_posted_before_collective();
  std::vector<std::vector<char>> orphans_;  // drop_arrivals' buffers (MPI may still write there)
  // The messages of this transport's point-to-point context since the last
  // settle_disagreement, per peer: posted to it, and taken from it (a receive
  // posted, or a probed message; a receive cancelled before it matched is
  // taken back). settle_disagreement exchanges `sent_`, so that every rank
  // receives what its peers sent it and nothing took.
  std::vector<int64_t> sent_, taken_;
  // What a disagreement left open (sends, withdrawn receives, messages of
  // another label being received) until settle_disagreement, and the
  // buffers those messages land in.
  std::vector<MPI_Request> unsettled_;
  std::vector<Pending> unsettled_pending_;
  std::vector<std::vector<char>> scratch_;
  // The MPI tag that carries a label: kFirstSignedTag and up.
  int signed_tag(uint32_t label) const;
  // Receives a message matched by a probe into `span`.
  void post_matched(const Span& span, MPI_Message* message, int peer);
  // Receives a probed message into a scratch buffer of its own size (kept until settled).
  void post_into_scratch(MPI_Message* message, int peer, size_t bytes);
  // Receives the probed messages not yet received into scratch; with
  // `settle`, their requests join unsettled_, else they are freed (after a
  // failure between the halves, MPI may still write to orphans_).
  void drop_arrivals(bool settle = false);
  // After a disagreement: cancels the labelled receives still open and moves
  // every open request of the current group to unsettled_.
  void leave_unsettled() { leave_unsettled(requests_, pending_); }
  void leave_unsettled(std::vector<MPI_Request>& requests, std::vector<Pending>& pending);
  // Waits (bounded) until the unsettled receives, or all unsettled requests,
  // have completed, taking back the receives whose cancellation succeeded.
  void complete_unsettled(bool receives_only, const char* what);
};

}  // namespace a2a
