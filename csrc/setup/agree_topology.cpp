#include "setup/agree_topology.hpp"

#include "core/error.hpp"

namespace a2a {

namespace {

const char* device_name(int device_type) { return device_type == A2A_DEVICE_CUDA ? "cuda" : "cpu"; }
const char* transport_name(int transport) {
  return transport == A2A_TRANSPORT_NCCL ? "nccl" : transport == A2A_TRANSPORT_EXTERNAL ? "external" : "mpi";
}

}  // namespace

LocalSizeProposal launcher_local_size(const a2a_comm_config_t& config, int size, SettingReader& settings) {
  LocalSizeProposal proposal;
  proposal.local_size = size;
  if (config.local_size > 0) {
    proposal.local_size = config.local_size;
    proposal.explicit_size = true;
    proposal.source = "local_size=";
    return proposal;
  }
  for (const char* name : {"A2A_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    const long value = settings.read([name] { return env_int(name); }, -1L);
    if (value > 0) {
      proposal.local_size = static_cast<int>(value);
      proposal.explicit_size = true;
      proposal.source = cat("the environment variable ", name);
      return proposal;
    }
  }
  return proposal;
}

Topology agree_topology(Transport& control, const LocalSizeProposal& proposal, const a2a_comm_config_t& config,
                        const SettingReader& settings) {
  const std::string& setting_error = settings.error();
  const int rank = control.rank(), size = control.size();
  int local_size = proposal.local_size;
  const int64_t given = proposal.explicit_size ? 1 : 0;
  const int64_t kind = (config.cross_check == 0 ? 256 : 0) + config.device_type * 16 + config.transport;
  // Maxima of (x, -x) give max and min in one allreduce.
  int64_t bounds[7] = {setting_error.empty() ? 0 : 1, local_size, -static_cast<int64_t>(local_size), given, -given,
                       kind, -kind};
  control.allreduce_int64(bounds, 7, ReduceOp::kMax);
  if (!setting_error.empty()) fail(settings.status(), "rank ", rank, ": ", setting_error);
  if (bounds[0] != 0)
    fail(A2A_ERROR_REMOTE, "rank ", rank, ": another rank rejected its settings while creating the communicator "
         "(see the error on that rank)");
  if (bounds[5] != -bounds[6])
    fail(A2A_ERROR_MISMATCH, "rank ", rank, ": ranks asked for different devices, transports or cross-checks; this "
         "rank asked for device=", device_name(config.device_type), ", transport=", transport_name(config.transport),
         ", cross_check=", config.cross_check == 0 ? 0 : 1);
  if (bounds[3] != -bounds[4])
    fail(A2A_ERROR_MISMATCH, "rank ", rank, ": local_size is given (", proposal.source, ") on some ranks but "
         "not on others; this rank ", proposal.explicit_size ? "has " : "does not have ", "one");
  std::string irregular = proposal.irregular_reason;
  if (bounds[1] != -bounds[2]) {
    if (proposal.explicit_size)
      fail(A2A_ERROR_MISMATCH, "rank ", rank, ": local_size differs across ranks (from ", -bounds[2], " to ",
           bounds[1], "; this rank has ", local_size, " from ", proposal.source, "); pass the same local_size "
           "on every rank");
    // Nodes of different sizes: the comm works for linear algorithms.
    if (irregular.empty())
      irregular = cat("nodes have different sizes (from ", -bounds[2], " to ", bounds[1],
                      " ranks); pass local_size= or set A2A_LOCAL_SIZE");
    local_size = 1;
  }
  if (size % local_size == 0 && irregular.empty()) return make_topology(rank, size, local_size);
  // Still usable for linear algorithms; 2DH reports why it cannot run.
  return block_topology(rank, size, local_size,
                            irregular.empty() ? cat("world size ", size, " is not divisible by local_size ", local_size,
                                                    proposal.explicit_size ? cat(" (from ", proposal.source, ")") : "")
                                              : irregular);
}

}  // namespace a2a
