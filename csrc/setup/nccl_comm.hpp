#pragma once

#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// Collective over the `size` ranks that pass the same NCCL unique id: a
// communicator whose data and control both go over NCCL (a2a_comm_create_nccl).
std::unique_ptr<Comm> create_nccl_comm(const void* id, int size, int rank, const a2a_comm_config_t& config);

}  // namespace a2a
