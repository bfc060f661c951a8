// Ranks are grouped into nodes of local_size consecutive ranks:
// rank = node * local_size + local_rank. One machine can emulate
// num_nodes x local_size by overriding local_size.
#pragma once

#include <string>

namespace a2a {

struct Topology {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int node = 0;
  int num_nodes = 1;
  // Empty when nodes are equal, contiguous blocks of ranks (2DH needs that);
  // otherwise why they are not, for the 2DH error message.
  std::string irregular_reason;

  bool regular() const { return irregular_reason.empty(); }
  int global_rank(int node_index, int local_index) const { return node_index * local_size + local_index; }
};

// Builds the topology for `local_size` ranks per node. Fails when size is not
// divisible by local_size.
Topology make_topology(int rank, int size, int local_size);

// Blocks of local_size consecutive ranks, without make_topology's checks;
// `reason` (empty when the blocks are regular) says why 2DH cannot run on a
// communicator that is usable by the linear algorithms only.
Topology block_topology(int rank, int size, int local_size, const std::string& reason);

}  // namespace a2a
