#include "core/topology.hpp"

#include <algorithm>

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

Topology split_topology(const std::vector<SplitEntry>& entries, int rank) {
  const int64_t color = entries[rank].color;
  std::vector<int> members;  // old ranks, in new rank order
  for (int r = 0; r < static_cast<int>(entries.size()); ++r)
    if (entries[r].color == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return entries[a].key < entries[b].key; });
  const int size = static_cast<int>(members.size());
  const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  // Runs of consecutive new ranks on one old node: regular when every old
  // node has a single run and the runs are of one length.
  std::vector<int64_t> run_nodes;
  std::vector<int> run_lengths;
  for (int i = 0; i < size; ++i) {
    const int64_t node = entries[members[i]].node;
    if (i > 0 && node == run_nodes.back()) {
      ++run_lengths.back();
    } else {
      run_nodes.push_back(node);
      run_lengths.push_back(1);
    }
  }
  std::vector<int64_t> sorted_nodes = run_nodes;
  std::sort(sorted_nodes.begin(), sorted_nodes.end());
  const bool one_run_per_node = std::adjacent_find(sorted_nodes.begin(), sorted_nodes.end()) == sorted_nodes.end();
  const bool equal_runs = std::all_of(run_lengths.begin(), run_lengths.end(),
                                      [&](int length) { return length == run_lengths.front(); });
  return make_topology(new_rank, size, one_run_per_node && equal_runs ? run_lengths.front() : 1);
}

}  // namespace a2a
