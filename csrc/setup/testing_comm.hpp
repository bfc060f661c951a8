// Tests only: host communicators that move their data, or their control
// values, through the staging transports of the CUDA communicators
// (core/staging.hpp), with host copies, so that the CPU test suite runs that
// code. Reached through a2a_testing_comm_create_mpi (a2a/a2a_testing.h, not
// installed); tests/mpi/conftest.py routes every communicator of the mpirun
// suite here when A2A_TEST_STAGING is set. No production path leads here.
#pragma once

#include <mpi.h>

#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// staging: "staged" (data through StagedTransport, as transport="mpi",
// device="cuda" does), "predicted" (the same, with the check of predicted
// calls posted, as transport="nccl", device="cuda" under MPI does) or
// "control" (control values through DeviceControlTransport, as a
// communicator made from a NCCL unique id does).
// Collective over `parent`, like create_mpi_comm; a host device only.
std::unique_ptr<Comm> create_staged_host_comm(MPI_Comm parent, const a2a_comm_config_t& config, const char* staging);

}  // namespace a2a
