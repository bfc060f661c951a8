#include "cpu/mpi_transport.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <cstdlib>
#include <thread>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/elementwise_reduce.hpp"
#include "cpu/mpi_util.hpp"

namespace a2a {


size_t max_int_count() {
  const char* text = std::getenv("A2A_MPI_MAX_COUNT");
  if (text == nullptr || *text == '\0') return INT_MAX;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 1 || value > INT_MAX)
    fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_MPI_MAX_COUNT='", text, "' is not an integer in [1, ", INT_MAX, "]");
  return static_cast<size_t>(value);
}

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_s, size_t max_count)
    : comm_(comm), timeout_s_(timeout_s), max_count_(max_count) {
  // Errors come back as codes and become a2a errors instead of aborting the job.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  sent_.assign(size_, 0);
  taken_.assign(size_, 0);
  // The largest tag: the signed exchange's signatures live in
  // [kFirstSignedTag, tag_ub_] (at least 32767 by the standard; 2^31 - 1 in
  // Open MPI and MPICH, where a signature keeps almost all of its 32 bits).
  int* tag_ub = nullptr;
  int found = 0;
  // The standard attaches it to MPI_COMM_WORLD; a duplicate may not carry it.
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found) == MPI_SUCCESS && found && tag_ub != nullptr)
    tag_ub_ = *tag_ub;
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  abandon(requests_, pending_);
  abandon(posted_.requests, posted_.pending);
  abandon(exchange_round_.requests, exchange_round_.pending);
  abandon(unsettled_, unsettled_pending_);
  MPI_Comm_free(&comm_);
}

void MpiTransport::group_start() {
  // A group that failed halfway (a post threw) must not leave active
  // requests behind.
  abandon(requests_, pending_);
  own_sends_.clear();
  own_recvs_.clear();
}

void MpiTransport::post(const Span& span, int peer, bool is_send, int tag, bool even_if_empty) {
  const size_t bytes = span.bytes();
  if (bytes == 0 && !even_if_empty) return;  // both sides agree on the size, so both skip it
  if (peer < 0 || peer >= size_)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank_, ": peer ", peer, " is outside [0, ", size_, ")");
  MPI_Request request;
  if (span.is_contiguous() && bytes <= max_count_) {
    const int count = static_cast<int>(bytes);
    if (is_send)
      A2A_MPI_CHECK(MPI_Isend(span.data, count, MPI_BYTE, peer, tag, comm_, &request), "rank ", rank_, " send to ", peer);
    else
      A2A_MPI_CHECK(MPI_Irecv(span.data, count, MPI_BYTE, peer, tag, comm_, &request), "rank ", rank_, " recv from ", peer);
  } else {
    MPI_Datatype type = span_type(span, max_count_, rank_);
    int rc = is_send ? MPI_Isend(span.data, 1, type, peer, tag, comm_, &request)
                     : MPI_Irecv(span.data, 1, type, peer, tag, comm_, &request);
    MPI_Type_free(&type);  // released by MPI once the operation completes
    if (rc != MPI_SUCCESS)
      fail(A2A_ERROR_TRANSPORT, "rank ", rank_, is_send ? " send to " : " recv from ", peer, " (", bytes,
           " bytes): ", mpi_error_text(rc));
  }
  requests_.push_back(request);
  pending_.push_back(Pending{is_send ? "send to" : "recv from", peer, bytes});
  ++(is_send ? sent_ : taken_)[peer];
}

// A message to oneself is a copy at group_end (as MPI's own collectives make
// it), not a trip through MPI's self transport: sends and receives to self
// pair up in the order they were posted, like any pair's messages.
void MpiTransport::send(const Span& span, int peer) {
  if (peer == rank_)
    own_sends_.push_back(span);
  else
    post(span, peer, true, kDataTag);
}

void MpiTransport::recv(const Span& span, int peer) {
  if (peer == rank_)
    own_recvs_.push_back(span);
  else
    post(span, peer, false, kDataTag);
}

void MpiTransport::group_end() {
  const size_t own = std::min(own_sends_.size(), own_recvs_.size());
  for (size_t i = 0; i < own; ++i) {
    if (own_sends_[i].bytes() != own_recvs_[i].bytes()) {
      abandon(requests_, pending_);
      fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": a message to itself of ", own_sends_[i].bytes(),
           " bytes meets a receive of ", own_recvs_[i].bytes());
    }
    copy_span(own_recvs_[i], own_sends_[i]);
  }
  const bool unpaired = own_sends_.size() != own_recvs_.size();
  own_sends_.clear();
  own_recvs_.clear();
  if (unpaired) {
    abandon(requests_, pending_);
    fail(A2A_ERROR_INTERNAL, "rank ", rank_, ": unpaired messages to itself in one group");
  }
  wait_all(requests_, pending_, "point-to-point exchange");
}

// Copies the bytes of `src` to `dst` (equal totals), block by block on both
// sides.
void MpiTransport::copy_span(const Span& dst, const Span& src) {
  size_t d = 0, d_at = 0, s = 0, s_at = 0;  // block and offset in it, on each side
  for (size_t left = src.bytes(); left > 0;) {
    const size_t bytes = std::min({left, dst.block_bytes - d_at, src.block_bytes - s_at});
    std::memcpy(static_cast<char*>(dst.data) + d * dst.stride_bytes + d_at,
                static_cast<const char*>(src.data) + s * src.stride_bytes + s_at, bytes);
    left -= bytes;
    if ((d_at += bytes) == dst.block_bytes) d_at = 0, ++d;
    if ((s_at += bytes) == src.block_bytes) s_at = 0, ++s;
  }
}

void MpiTransport::abandon(std::vector<MPI_Request>& requests, std::vector<Pending>& pending) {
  // Unmatched receives are cancelled so that no late message lands in the
  // caller's buffer; sends cannot be withdrawn reliably and are left to MPI.
  // Requests of nonblocking collectives (peer < 0) may be neither cancelled
  // nor freed: they are dropped, and the comm is retired by the caller.
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == MPI_REQUEST_NULL || pending[i].peer < 0) continue;
    if (std::string(pending[i].kind) == "recv from") MPI_Cancel(&requests[i]);
    MPI_Request_free(&requests[i]);
  }
  requests.clear();
  pending.clear();
}

void MpiTransport::wait_all(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what,
                            bool watch) {
  PollPacer pacer(timeout_s_);
  wait_statuses_.resize(requests.size());
  for (unsigned idle = 1;; ++idle) {
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, wait_statuses_.data());
    if (rc != MPI_SUCCESS) fail_error(requests, pending, what, rc, wait_statuses_.data());
    if (done) {
      requests.clear();
      pending.clear();
      return;
    }
    if (watch && (idle & 15) == 0) watch_posted_check(requests, pending);
    if (!pacer.keep_waiting()) break;
  }
  // MPI_Testall leaves finished requests in place when not all are done;
  // test each one so that only the unfinished are reported.
  for (auto& request : requests) {
    int finished = 0;
    if (request != MPI_REQUEST_NULL) MPI_Test(&request, &finished, MPI_STATUS_IGNORE);
  }
  fail_timeout(requests, pending, what);
}

std::string MpiTransport::describe(const Pending& pending) {
  return cat(pending.kind, pending.peer >= 0 ? cat(" rank ", pending.peer, " (", pending.bytes, " bytes)") : "");
}

namespace {

// A list of at most 16 operations, then how many more.
class OperationList {
 public:
  void add(const std::string& item) {
    if (count_++ < 16) text_ += cat(count_ > 1 ? ", " : "", item);
  }
  bool empty() const { return count_ == 0; }
  std::string text() const { return count_ > 16 ? cat(text_, ", and ", count_ - 16, " more") : text_; }

 private:
  std::string text_;
  size_t count_ = 0;
};

}  // namespace

void MpiTransport::fail_timeout(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what) {
  OperationList unfinished;
  for (size_t i = 0; i < requests.size(); ++i)
    if (requests[i] != MPI_REQUEST_NULL) unfinished.add(describe(pending[i]));
  abandon(requests, pending);
  fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_, " s (A2A_TIMEOUT_S) in ", what,
       "; unfinished: ", unfinished.text(),
       ". Those peers did not call the same collective, died, or are stuck");
}

// Open MPI frees a request that failed before MPI_Testall returns MPI_ERR_IN_STATUS: the statuses
// alone say which failed. On any other error the requests still allocated are those unfinished.
void MpiTransport::fail_error(std::vector<MPI_Request>& requests, std::vector<Pending>& pending, const char* what,
                              int rc, const MPI_Status* statuses) {
  OperationList failed, unfinished;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int error = rc == MPI_ERR_IN_STATUS && statuses != nullptr ? statuses[i].MPI_ERROR
                      : requests[i] != MPI_REQUEST_NULL             ? MPI_ERR_PENDING
                                                                    : MPI_SUCCESS;
    if (error == MPI_ERR_PENDING)
      unfinished.add(describe(pending[i]));
    else if (error != MPI_SUCCESS)
      failed.add(cat(describe(pending[i]), ": ", mpi_error_text(error)));
  }
  abandon(requests, pending);
  fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", what, " failed: ",
       failed.empty() ? mpi_error_text(rc) : failed.text(), unfinished.empty() ? "" : "; unfinished: ",
       unfinished.text());
}

void MpiTransport::wait_one(MPI_Request request, const char* what) {
  std::vector<MPI_Request> requests{request};
  std::vector<Pending> pending{Pending{"a collective over all ranks", -1, 0}};
  wait_all(requests, pending, what, false);
}

// Direct sends to every rank rather than MPI_Iallgather: one round of small
// messages (cheaper than a collective schedule here), and a timeout can name
// exactly the ranks whose contribution never arrived.
void MpiTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  auto* out = static_cast<char*>(recv);
  std::memcpy(out + static_cast<size_t>(rank_) * bytes_per_rank, send, bytes_per_rank);
  group_start();
  for (int step = 1; step < size_; ++step) {
    const int from = (rank_ - step + size_) % size_;
    post(Span::contiguous(out + static_cast<size_t>(from) * bytes_per_rank, bytes_per_rank), from, false, kGatherTag);
  }
  for (int step = 1; step < size_; ++step)
    post(Span::contiguous(send, bytes_per_rank), (rank_ + step) % size_, true, kGatherTag);
  wait_all(requests_, pending_, "argument check (allgather)");
}

namespace {

// float16 / bfloat16 reductions, which MPI lacks: core/elementwise_reduce.hpp's, as
// user operations.
template <a2a_dtype_t Dtype, ReduceOp Op>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(inout, in, static_cast<size_t>(*len), Dtype, Op);
}

// The MPI datatype and operation of a reduction. The 16-bit float ops are
// created once per process (MPI_Op_create is local and cheap to keep).
std::pair<MPI_Datatype, MPI_Op> mpi_reduction(a2a_dtype_t dtype, ReduceOp op) {
  const MPI_Op builtin = op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMax ? MPI_MAX : MPI_MIN;
  switch (dtype) {
    case A2A_FLOAT32: return {MPI_FLOAT, builtin};
    case A2A_FLOAT64: return {MPI_DOUBLE, builtin};
    case A2A_INT8: return {MPI_INT8_T, builtin};
    case A2A_INT32: return {MPI_INT32_T, builtin};
    case A2A_INT64: return {MPI_INT64_T, builtin};
    case A2A_UINT8: return {MPI_UINT8_T, builtin};
    case A2A_FLOAT16:
    case A2A_BFLOAT16: break;
  }
  // All six at the first use (MPI is initialized by then: a communicator
  // exists); a function-local static is initialized once, thread-safely.
  struct Ops {
    MPI_Op op[2][3];
    int rc = MPI_SUCCESS;
    Ops() {
      MPI_User_function* const functions[2][3] = {
          {reduce_16bit<A2A_FLOAT16, ReduceOp::kSum>, reduce_16bit<A2A_FLOAT16, ReduceOp::kMax>,
           reduce_16bit<A2A_FLOAT16, ReduceOp::kMin>},
          {reduce_16bit<A2A_BFLOAT16, ReduceOp::kSum>, reduce_16bit<A2A_BFLOAT16, ReduceOp::kMax>,
           reduce_16bit<A2A_BFLOAT16, ReduceOp::kMin>}};
      for (int kind = 0; kind < 2; ++kind)
        for (int which = 0; which < 3; ++which)
          if (rc == MPI_SUCCESS) rc = MPI_Op_create(functions[kind][which], 1, &op[kind][which]);
    }
  };
  static const Ops ops;
  if (ops.rc != MPI_SUCCESS)
    fail(A2A_ERROR_TRANSPORT, "MPI_Op_create (float16/bfloat16 reductions) failed: ", mpi_error_text(ops.rc));
  return {MPI_UINT16_T, ops.op[dtype == A2A_FLOAT16 ? 0 : 1][static_cast<int>(op)]};
}

}  // namespace

// In pieces of at most max_count_ bytes' worth of elements, so that MPI's int
// counts never overflow (and tests reach this with A2A_MPI_MAX_COUNT).
void MpiTransport::allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  complete_posted_before_collective();
  const auto [type, mpi_op] = mpi_reduction(dtype, op);
  const size_t item = dtype_size(dtype);
  const size_t piece = std::max<size_t>(1, std::min<size_t>(max_count_ / item, INT_MAX));
  const bool in_place = send == recv;
  for (size_t done = 0; done < count; done += piece) {
    const int n = static_cast<int>(std::min(piece, count - done));
    char* out = static_cast<char*>(recv) + done * item;
    const void* in = in_place ? MPI_IN_PLACE : static_cast<const char*>(send) + done * item;
    MPI_Request request;
    A2A_MPI_CHECK(MPI_Iallreduce(in, out, n, type, mpi_op, comm_, &request), "rank ", rank_, " allreduce");
    wait_one(request, "allreduce");
  }
}

// Directly while a block fits MPI's int counts (and A2A_MPI_MAX_COUNT);
// otherwise in pieces: piece [o, o + n) of every rank's block is packed into
// one buffer of size * n elements, whose reduce-scatter gives this rank's
// elements [o, o + n).
void MpiTransport::reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                                  ReduceOp op) {
  complete_posted_before_collective();
  const auto [type, mpi_op] = mpi_reduction(dtype, op);
  const size_t item = dtype_size(dtype);
  const size_t piece = std::max<size_t>(1, std::min<size_t>(max_count_ / item, INT_MAX / size_));
  const auto* in = static_cast<const char*>(send);
  auto* out = static_cast<char*>(recv);
  std::vector<char> packed(count_per_rank > piece ? piece * item * size_ : 0);
  for (size_t done = 0; done < count_per_rank; done += piece) {
    const size_t n = std::min(piece, count_per_rank - done);
    const void* blocks = in;
    if (count_per_rank > piece) {
      for (int r = 0; r < size_; ++r)
        std::memcpy(packed.data() + r * n * item, in + (r * count_per_rank + done) * item, n * item);
      blocks = packed.data();
    }
    MPI_Request request;
    A2A_MPI_CHECK(MPI_Ireduce_scatter_block(blocks, out + done * item, static_cast<int>(n), type, mpi_op, comm_, &request),
                  "rank ", rank_, " reduce_scatter");
    wait_one(request, "reduce_scatter");
  }
}

// Point-to-point like allgather rather than MPI_Iallgatherv, whose int
// counts and displacements stop at 2^31 bytes of gathered data: each block
// travels as a Span (a derived datatype when it is that large), and a timeout
// names the ranks whose block never arrived.
void MpiTransport::allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) {
  const std::vector<size_t> offset = packed_offsets(bytes_per_rank);
  auto* out = static_cast<char*>(recv);
  const size_t mine = bytes_per_rank[rank_];
  if (mine != 0) std::memcpy(out + offset[rank_], send, mine);
  group_start();
  for (int step = 1; step < size_; ++step) {
    const int from = (rank_ - step + size_) % size_;
    post(Span::contiguous(out + offset[from], bytes_per_rank[from]), from, false, kDataTag);
  }
  for (int step = 1; step < size_; ++step) post(Span::contiguous(send, mine), (rank_ + step) % size_, true, kDataTag);
  wait_all(requests_, pending_, "allgather_v");
}

// MPI_Ireduce_scatter directly while every block fits MPI's int counts (and
// A2A_MPI_MAX_COUNT); otherwise in rounds, as reduce_scatter does: round o
// packs elements [o, o + piece) of every block (fewer, or none, where a block
// is shorter) into one buffer, whose reduce-scatter gives this rank's
// elements [o, o + piece).
void MpiTransport::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts,
                                    a2a_dtype_t dtype, ReduceOp op) {
  complete_posted_before_collective();
  const auto [type, mpi_op] = mpi_reduction(dtype, op);
  const size_t item = dtype_size(dtype);
  const size_t piece = std::max<size_t>(1, std::min<size_t>(max_count_ / item, INT_MAX / size_));
  std::vector<size_t> start(size_ + 1, 0);
  for (int r = 0; r < size_; ++r) start[r + 1] = start[r] + counts[r];
  const size_t longest = *std::max_element(counts.begin(), counts.end());
  const auto* in = static_cast<const char*>(send);
  auto* out = static_cast<char*>(recv);
  const bool direct = longest <= piece;
  std::vector<char> packed(direct ? 0 : piece * item * size_);
  std::vector<int> round_counts(size_);
  for (size_t done = 0; done < longest; done += piece) {
    const void* blocks = in;
    size_t at = 0;
    for (int r = 0; r < size_; ++r) {
      const size_t n = counts[r] > done ? std::min(piece, counts[r] - done) : 0;
      round_counts[r] = static_cast<int>(n);
      if (!direct && n != 0) std::memcpy(packed.data() + at * item, in + (start[r] + done) * item, n * item);
      at += n;
    }
    if (!direct) blocks = packed.data();
    MPI_Request request;
    A2A_MPI_CHECK(MPI_Ireduce_scatter(blocks, out + std::min(done, counts[rank_]) * item, round_counts.data(), type,
                                      mpi_op, comm_, &request),
                  "rank ", rank_, " reduce_scatter_v");
    wait_one(request, "reduce_scatter_v");
  }
}

void MpiTransport::barrier() {
  complete_posted_before_collective();
  MPI_Request request;
  A2A_MPI_CHECK(MPI_Ibarrier(comm_, &request), "rank ", rank_, " barrier");
  wait_one(request, "barrier");
}

}  // namespace a2a
