// Which ranks of an MPI communicator share a node, from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED).
#pragma once

#include <mpi.h>

#include <string>

namespace a2a {

// Ranks per node. Collective over `comm`. Nodes that are not equal, contiguous
// blocks of ranks are reported through *irregular_reason. Every MPI call is
// checked (A2A_ERROR_TRANSPORT naming the call and the rank), and the two
// exchanges are nonblocking collectives bounded by timeout_s
// (A2A_ERROR_TIMEOUT). MPI_Comm_split_type itself has no nonblocking form:
// it waits for every rank of `comm`, unbounded.
int detect_local_size(MPI_Comm comm, double timeout_s, std::string* irregular_reason);

}  // namespace a2a
