#include "core/topology.hpp"

#include "core/error.hpp"

namespace a2a {

Topology make_topology(int rank, int size, int local_size) {
  if (local_size <= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, ": local_size must be positive, got ", local_size);
  if (size % local_size != 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, ": world size ", size,
         " is not divisible by local_size ", local_size,
         "; nodes must be equal blocks of consecutive ranks");
  return block_topology(rank, size, local_size, "");
}

Topology block_topology(int rank, int size, int local_size, const std::string& reason) {
  Topology topo;
  topo.rank = rank;
  topo.size = size;
  topo.local_size = local_size;
  topo.local_rank = rank % local_size;
  topo.node = rank / local_size;
  topo.num_nodes = (size + local_size - 1) / local_size;
  topo.irregular_reason = reason;
  return topo;
}

}  // namespace a2a
