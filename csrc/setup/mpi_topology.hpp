// Which ranks of an MPI communicator share a node, from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED).
#pragma once

#include <mpi.h>

#include <string>

namespace a2a {

// Ranks per node. Collective over `comm`. Nodes that are not equal, contiguous
// blocks of ranks are reported through *irregular_reason.
int detect_local_size(MPI_Comm comm, std::string* irregular_reason);

}  // namespace a2a
