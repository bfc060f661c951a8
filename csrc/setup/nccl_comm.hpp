#pragma once

#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// Collective over the `size` ranks that pass the same NCCL unique id: a
// communicator whose data goes over NCCL, and its control values and
// argument check over `control` where given (a2a_comm_create_nccl_with_control:
// the check of a predicted call posted, no wait for the stream), else over
// NCCL itself through a device buffer (a2a_comm_create_nccl). control->release
// runs once the last communicator over it is gone, on failure too.
std::unique_ptr<Comm> create_nccl_comm(const void* id, int size, int rank, const a2a_comm_config_t& config,
                                       const a2a_transport_ops_t* control = nullptr);

}  // namespace a2a
