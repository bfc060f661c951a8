#include "cpu/mpi_transport.hpp"

#include <chrono>
#include <climits>
#include <cstdlib>
#include <thread>

#include "core/error.hpp"

namespace a2a {

namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

#define A2A_MPI_CHECK(call, ...)                                                            \
  do {                                                                                      \
    int a2a_mpi_rc = (call);                                                                \
    if (a2a_mpi_rc != MPI_SUCCESS)                                                          \
      fail(A2A_ERROR_TRANSPORT, __VA_ARGS__, ": " #call " failed: ", mpi_error_text(a2a_mpi_rc)); \
  } while (0)

// A datatype of exactly `bytes` contiguous bytes, built from pieces of at most
// `unit` bytes so that no int count overflows (the BigMPI construction).
MPI_Datatype contiguous_bytes_type(size_t bytes, size_t unit) {
  MPI_Datatype type;
  if (bytes <= unit) {
    MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type);
    return type;
  }
  const size_t full = bytes / unit, rest = bytes % unit;
  if (full > static_cast<size_t>(INT_MAX)) fail(A2A_ERROR_UNSUPPORTED, "message of ", bytes, " bytes is too large");
  MPI_Datatype unit_type, full_type;
  MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &unit_type);
  MPI_Type_contiguous(static_cast<int>(full), unit_type, &full_type);
  MPI_Type_free(&unit_type);
  if (rest == 0) return full_type;
  MPI_Datatype rest_type;
  MPI_Type_contiguous(static_cast<int>(rest), MPI_BYTE, &rest_type);
  int lengths[2] = {1, 1};
  MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(full * unit)};
  MPI_Datatype types[2] = {full_type, rest_type};
  MPI_Type_create_struct(2, lengths, displacements, types, &type);
  MPI_Type_free(&full_type);
  MPI_Type_free(&rest_type);
  return type;
}

double read_env_double(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || value <= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "environment variable ", name, "='", text, "' is not a positive number");
  return value;
}

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  max_count_ = static_cast<size_t>(read_env_double("A2A_MPI_MAX_COUNT", INT_MAX));
  if (max_count_ > static_cast<size_t>(INT_MAX)) max_count_ = INT_MAX;
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

void MpiTransport::group_start() {
  requests_.clear();
  pending_.clear();
}

void MpiTransport::post(const Span& span, int peer, bool is_send) {
  const size_t bytes = span.bytes();
  if (bytes == 0) return;  // both sides agree on the size, so both skip it
  if (peer < 0 || peer >= size_)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank_, ": peer ", peer, " is outside [0, ", size_, ")");
  MPI_Request request;
  const int tag = 0x2a2a;
  if (span.is_contiguous() && bytes <= max_count_) {
    const int count = static_cast<int>(bytes);
    if (is_send)
      A2A_MPI_CHECK(MPI_Isend(span.data, count, MPI_BYTE, peer, tag, comm_, &request), "rank ", rank_, " send to ", peer);
    else
      A2A_MPI_CHECK(MPI_Irecv(span.data, count, MPI_BYTE, peer, tag, comm_, &request), "rank ", rank_, " recv from ", peer);
  } else {
    MPI_Datatype type;
    if (span.is_contiguous()) {
      type = contiguous_bytes_type(bytes, max_count_);
    } else {
      if (span.num_blocks > static_cast<size_t>(INT_MAX))
        fail(A2A_ERROR_UNSUPPORTED, "rank ", rank_, ": a layout of ", span.num_blocks, " blocks exceeds MPI's int count");
      MPI_Datatype block = contiguous_bytes_type(span.block_bytes, max_count_);
      MPI_Type_create_hvector(static_cast<int>(span.num_blocks), 1, static_cast<MPI_Aint>(span.stride_bytes), block, &type);
      MPI_Type_free(&block);
    }
    MPI_Type_commit(&type);
    int rc = is_send ? MPI_Isend(span.data, 1, type, peer, tag, comm_, &request)
                     : MPI_Irecv(span.data, 1, type, peer, tag, comm_, &request);
    MPI_Type_free(&type);  // released by MPI once the operation completes
    if (rc != MPI_SUCCESS)
      fail(A2A_ERROR_TRANSPORT, "rank ", rank_, is_send ? " send to " : " recv from ", peer, " (", bytes,
           " bytes): ", mpi_error_text(rc));
  }
  requests_.push_back(request);
  pending_.push_back(Pending{is_send ? "send to" : "recv from", peer, bytes});
}

void MpiTransport::send(const Span& span, int peer) { post(span, peer, true); }
void MpiTransport::recv(const Span& span, int peer) { post(span, peer, false); }

void MpiTransport::group_end() { wait_all("point-to-point exchange"); }

void MpiTransport::wait_all(const char* what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  int done = 0;
  for (unsigned spins = 0;; ++spins) {
    A2A_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE),
                  "rank ", rank_, " ", what);
    if (done) break;
    // Test the clock and yield only now and then: both cost more than a poll.
    if ((spins & 63) == 63) {
      if (clock::now() > deadline) break;
      std::this_thread::yield();
    }
  }
  if (done) {
    requests_.clear();
    pending_.clear();
    return;
  }
  std::string unfinished;
  size_t listed = 0;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    if (listed++ < 16) unfinished += cat(listed > 1 ? ", " : "", pending_[i].kind, " rank ", pending_[i].peer, " (", pending_[i].bytes, " bytes)");
    // Unmatched receives are cancelled so that no late message lands in the
    // caller's buffer; sends cannot be withdrawn reliably and are left to MPI.
    if (std::string(pending_[i].kind) == "recv from") {
      MPI_Cancel(&requests_[i]);
      MPI_Request_free(&requests_[i]);
    } else {
      MPI_Request_free(&requests_[i]);
    }
  }
  if (listed > 16) unfinished += cat(", and ", listed - 16, " more");
  requests_.clear();
  pending_.clear();
  fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_, " s (A2A_TIMEOUT_S) in ", what,
       "; unfinished: ", unfinished, ". A peer did not call the same collective, died, or is stuck");
}

void MpiTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  if (bytes_per_rank > static_cast<size_t>(INT_MAX)) fail(A2A_ERROR_UNSUPPORTED, "allgather of ", bytes_per_rank, " bytes per rank");
  group_start();
  MPI_Request request;
  A2A_MPI_CHECK(MPI_Iallgather(send, static_cast<int>(bytes_per_rank), MPI_BYTE, recv, static_cast<int>(bytes_per_rank),
                               MPI_BYTE, comm_, &request),
                "rank ", rank_, " allgather");
  requests_.push_back(request);
  pending_.push_back(Pending{"allgather with", -1, bytes_per_rank});
  wait_all("allgather");
}

void MpiTransport::allreduce_int64(int64_t* values, size_t count, ReduceOp op) {
  MPI_Op mpi_op = op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMax ? MPI_MAX : MPI_MIN;
  group_start();
  MPI_Request request;
  A2A_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, values, static_cast<int>(count), MPI_INT64_T, mpi_op, comm_, &request),
                "rank ", rank_, " allreduce");
  requests_.push_back(request);
  pending_.push_back(Pending{"allreduce with", -1, count * sizeof(int64_t)});
  wait_all("argument check (allreduce)");
}

void MpiTransport::barrier() {
  group_start();
  MPI_Request request;
  A2A_MPI_CHECK(MPI_Ibarrier(comm_, &request), "rank ", rank_, " barrier");
  requests_.push_back(request);
  pending_.push_back(Pending{"barrier with", -1, 0});
  wait_all("barrier");
}

int detect_local_size(MPI_Comm comm, std::string* irregular_reason) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm node_comm;
  A2A_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_comm), "rank ", rank,
                " topology detection");
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node_comm, &local_rank);
  MPI_Comm_size(node_comm, &local_size);
  // The node's first rank identifies it; regular nodes are the blocks
  // [k * local_size, (k + 1) * local_size).
  int leader = rank;
  MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, node_comm);
  MPI_Comm_free(&node_comm);
  int mine[2] = {leader, local_size};
  std::vector<int> all(2 * static_cast<size_t>(size));
  MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm);
  for (int r = 0; r < size; ++r) {
    if (all[2 * r + 1] != local_size || all[2 * r] != r - r % local_size) {
      *irregular_reason = cat("MPI shared-memory nodes are not equal blocks of consecutive ranks (rank ", r,
                              " is on the node of rank ", all[2 * r], " with ", all[2 * r + 1],
                              " ranks); pass local_size= or set A2A_LOCAL_SIZE");
      break;
    }
  }
  return local_size;
}

}  // namespace a2a
