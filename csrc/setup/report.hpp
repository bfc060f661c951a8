// What communicator creation says on the debug channel (core/debug.hpp):
// the topology and where local_size came from, the transports and device.
#pragma once

#include <string>

#include "core/comm.hpp"

namespace a2a {

// An INFO line about a communicator just made. `origin` names the factory
// ("MPI", "a NCCL unique id"); `local_size_source` says where local_size came
// from; `extra` is appended (e.g. the MPI thread level).
void report_created(Comm& comm, const char* origin, const std::string& local_size_source, double timeout_s,
                    const std::string& extra = "");

}  // namespace a2a
