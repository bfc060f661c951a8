#include "setup/mpi_topology.hpp"

#include <memory>
#include <vector>

#include "core/error.hpp"
#include "setup/mpi_calls.hpp"

namespace a2a {

namespace {

constexpr const char* kWhat = "topology detection";

// The node's communicator, freed however detection ends (a pending
// collective on it completes or is abandoned with it).
class NodeComm {
 public:
  NodeComm(MPI_Comm comm, int rank) {
    check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &comm_), "MPI_Comm_split_type",
              rank, kWhat);
  }
  ~NodeComm() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  NodeComm(const NodeComm&) = delete;
  NodeComm& operator=(const NodeComm&) = delete;
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace

int detect_local_size(MPI_Comm comm, double timeout_s, std::string* irregular_reason) {
  int rank = -1, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", rank, kWhat);
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank, kWhat);
  // Not boundable: there is no nonblocking MPI_Comm_split_type.
  const NodeComm node(comm, rank);
  int local_size = 1;
  check_mpi(MPI_Comm_size(node.get(), &local_size), "MPI_Comm_size (node)", rank, kWhat);
  // The node's first rank identifies it; regular nodes are the blocks
  // [k * local_size, (k + 1) * local_size). On the heap: a timed-out
  // exchange may still write its buffers later (wait_mpi leaks them then).
  struct Exchange {
    int leader;
    int mine[2];
    std::vector<int> all;
  };
  auto exchange = std::make_unique<Exchange>(Exchange{rank, {}, std::vector<int>(2 * static_cast<size_t>(size))});
  MPI_Request request;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, &exchange->leader, 1, MPI_INT, MPI_MIN, node.get(), &request),
            "MPI_Iallreduce", rank, kWhat);
  wait_mpi(request, "MPI_Iallreduce over the node", rank, size, timeout_s, kWhat, exchange);
  exchange->mine[0] = exchange->leader;
  exchange->mine[1] = local_size;
  check_mpi(MPI_Iallgather(exchange->mine, 2, MPI_INT, exchange->all.data(), 2, MPI_INT, comm, &request),
            "MPI_Iallgather", rank, kWhat);
  wait_mpi(request, "MPI_Iallgather", rank, size, timeout_s, kWhat, exchange);
  const std::vector<int>& all = exchange->all;
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
