#include "setup/report.hpp"

#include "core/debug.hpp"

namespace a2a {

void report_created(Comm& comm, const char* origin, const std::string& local_size_source, double timeout_s,
                    const std::string& extra) {
  if (!debug::enabled(debug::Level::kInfo)) return;
  const Topology& topo = comm.topology();
  debug::info("communicator created from ", origin, ": rank ", topo.rank, " of ", topo.size, ", ", topo.num_nodes,
              " nodes x ", topo.local_size, " ranks (local_size from ", local_size_source, ")",
              topo.regular() ? std::string() : cat(", irregular: ", topo.irregular_reason, "; 2dh unavailable"),
              "; data transport ", comm.transport().name(), ", control transport ", comm.control().name(),
              ", device ", comm.device().name(), ", timeout ", timeout_s, " s",
              comm.cross_checks() ? "" : ", cross-rank check off", extra);
}

}  // namespace a2a
