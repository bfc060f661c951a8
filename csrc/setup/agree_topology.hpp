// Agreeing, across the ranks of a communicator being created, on its
// settings (a bad one on any rank fails every rank), its device and
// transport, and its topology (local_size).
#pragma once

#include <string>

#include "a2a/a2a.h"
#include "core/topology.hpp"
#include "core/transport.hpp"
#include "setup/settings.hpp"

namespace a2a {

// How a rank sees its node before the agreement.
struct LocalSizeProposal {
  int local_size = 1;
  bool explicit_size = false;     // given by the caller or the environment, not detected
  std::string source;             // where it came from, for errors
  std::string irregular_reason;   // detection found unequal or non-contiguous nodes
};

// For a communicator made without MPI (from a NCCL unique id, or over an
// external transport): local_size=, else A2A_LOCAL_SIZE, else the launcher's
// LOCAL_WORLD_SIZE (torchrun) or OMPI_COMM_WORLD_LOCAL_SIZE (mpirun), else
// one node of `size` ranks. A bad variable is kept in `settings`.
LocalSizeProposal launcher_local_size(const a2a_comm_config_t& config, int size, SettingReader& settings);

// Collective over `control`: shares setting errors (this rank's are in
// `settings`), checks that device_type and transport agree, that a given
// local_size is given and equal everywhere, and builds the topology (an
// irregular one still works for the linear algorithms).
Topology agree_topology(Transport& control, const LocalSizeProposal& proposal, const a2a_comm_config_t& config,
                        const SettingReader& settings);

}  // namespace a2a
