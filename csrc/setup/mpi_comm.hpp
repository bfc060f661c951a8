// Communicators over an MPI communicator (a2a_comm_create_mpi).
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// Collective over `parent`: reads the settings, duplicates it, detects or
// applies the topology, and builds a communicator with the device and
// transport of `config`: host memory over MPI; or CUDA memory over NCCL, or
// over MPI staged through page-locked host memory.
std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config);

// How a host communicator's transports are arranged, when not MPI for both
// data and control. Gets the parts with the CPU device and the MPI transport
// as `data` and `control`, and the timeout. Only the test-only factory
// (setup/testing_comm.hpp) passes one. The communicator keeps it: its splits
// (Comm::split) are arranged alike.
using HostArrangement = std::function<void(CommParts& parts, double timeout_s)>;
std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config, const HostArrangement& arrange);

}  // namespace a2a
