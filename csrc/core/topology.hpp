// Ranks are grouped into nodes of local_size consecutive ranks:
// rank = node * local_size + local_rank. One machine can emulate
// num_nodes x local_size by overriding local_size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// What each rank brings to Comm::split: its color (A2A_UNDEFINED: none), its
// key, and its node in the communicator being split.
struct SplitEntry {
  int64_t color;
  int64_t key;
  int64_t node;
};

// The topology of rank `rank`'s new communicator in a split where rank r
// brought entries[r] (its color defined): the ranks of its color ordered by
// (key, rank). Nodes follow the old ones: when the new ranks on each old node
// are one block of consecutive new ranks, and the blocks are of equal size,
// local_size is that size, else 1. Every rank of the new communicator holds
// the same entries, so all of them reach the same local_size.
Topology split_topology(const std::vector<SplitEntry>& entries, int rank);

}  // namespace a2a
