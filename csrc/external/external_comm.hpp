// A host communicator over a caller's transport (a2a_comm_create_external):
// the ExternalTransport carries both the data and the control values, and
// its splits map their ranks onto the same channel with a tag of their own.
#pragma once

#include <memory>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// Collective over the `size` ranks of ops. ops->release runs once the last
// communicator over ops is gone, or before a failure returns.
std::unique_ptr<Comm> create_external_comm(const a2a_transport_ops_t& ops, int size, int rank,
                                           const a2a_comm_config_t& config);

}  // namespace a2a
