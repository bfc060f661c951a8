#include "setup/mpi_topology.hpp"

#include <vector>

#include "core/error.hpp"

namespace a2a {

int detect_local_size(MPI_Comm comm, std::string* irregular_reason) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm node_comm;
  const int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_comm);
  if (rc != MPI_SUCCESS) fail(A2A_ERROR_TRANSPORT, "rank ", rank, " topology detection: MPI_Comm_split_type failed");
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
