#pragma once

#include <mpi.h>

#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// Collective over `parent`: duplicates it, detects or applies the topology,
// and builds a Comm with the MPI transport and the CPU device.
std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config);

}  // namespace a2a
