#include "cpu/mpi_comm.hpp"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/backends.hpp"
#include "core/comm_setup.hpp"
#include "core/error.hpp"
#include "core/staging.hpp"
#include "cpu/cpu_device.hpp"
#include "cpu/mpi_transport.hpp"

namespace a2a {

namespace {

// A2A_TEST_STAGING=staged|control (tests only) builds a host communicator
// whose data or control messages go through the staging transports with host
// copies, so that the CPU suite runs the code that CUDA communicators use.
std::string test_staging() {
  const char* text = std::getenv("A2A_TEST_STAGING");
  const std::string value = text == nullptr ? "" : text;
  if (!value.empty() && value != "staged" && value != "control")
    fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_TEST_STAGING='", value, "': expected 'staged' or 'control'");
  return value;
}

void check_choice(const a2a_comm_config_t& config) {
  if (config.device_type != A2A_DEVICE_CPU && config.device_type != A2A_DEVICE_CUDA)
    fail(A2A_ERROR_INVALID_ARGUMENT, "config.device_type ", config.device_type, " is neither CPU (0) nor CUDA (1)");
  if (config.transport != A2A_TRANSPORT_MPI && config.transport != A2A_TRANSPORT_NCCL)
    fail(A2A_ERROR_INVALID_ARGUMENT, "config.transport ", config.transport, " is neither MPI (0) nor NCCL (1)");
  if (config.transport == A2A_TRANSPORT_NCCL && config.device_type != A2A_DEVICE_CUDA)
    fail(A2A_ERROR_INVALID_ARGUMENT, "transport NCCL moves CUDA memory: it needs device_type CUDA");
}

}  // namespace

std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) fail(A2A_ERROR_INVALID_ARGUMENT, "MPI is not initialized (import mpi4py or call MPI_Init first)");
  if (parent == MPI_COMM_NULL) fail(A2A_ERROR_INVALID_ARGUMENT, "the MPI communicator is MPI_COMM_NULL");
  // A bad setting on one rank must not leave the others waiting: settings
  // are read first, every rank makes the same collective calls, and the
  // verdict is shared in agree_topology.
  SettingReader settings;
  const double timeout_s = settings.read([&] { return timeout_from(config); }, kDefaultTimeoutS);
  const long env_local = settings.read([] { return env_int("A2A_LOCAL_SIZE"); }, -1L);
  const size_t max_count = settings.read([] { return max_int_count(); }, static_cast<size_t>(INT_MAX));
  int use_datatypes = config.use_mpi_datatypes;
  if (use_datatypes < 0) use_datatypes = settings.read([] { return env_int("A2A_MPI_DATATYPES"); }, -1L) == 0 ? 0 : 1;
  settings.read([&] { check_choice(config); return 0; }, 0);
  const bool cuda = config.device_type == A2A_DEVICE_CUDA;
  const std::string staging_test = cuda ? "" : settings.read([] { return test_staging(); }, std::string());
  // The device comes first: a bad ordinal or a build without CUDA is a
  // setting error, shared before any rank waits in NCCL's creation.
  std::unique_ptr<Device> device;
  if (cuda)
    device = settings.read([&] { return make_cuda_device(config.cuda_device); }, std::unique_ptr<Device>());
  else
    device = std::make_unique<CpuDevice>();

  MPI_Comm dup;
  int rc = MPI_Comm_dup(parent, &dup);
  if (rc != MPI_SUCCESS) fail(A2A_ERROR_TRANSPORT, "MPI_Comm_dup failed with code ", rc);
  auto mpi = std::make_unique<MpiTransport>(dup, timeout_s, max_count);

  // Detection runs on every rank (it is collective) even where local_size is given.
  LocalSizeProposal proposal;
  proposal.local_size = detect_local_size(dup, &proposal.irregular_reason);
  proposal.source = "local_size= / A2A_LOCAL_SIZE";
  const int given = config.local_size > 0 ? config.local_size : static_cast<int>(env_local > 0 ? env_local : 0);
  if (given > 0) {
    proposal.local_size = given;
    proposal.explicit_size = true;
    proposal.irregular_reason.clear();
  }
  const Topology topo = agree_topology(*mpi, proposal, config, settings);

  CommParts parts;
  parts.control = mpi.get();
  parts.transports.push_back(std::move(mpi));
  Transport& host = *parts.control;
  if (config.transport == A2A_TRANSPORT_NCCL) {
    // Rank 0 makes the id; everyone takes rank 0's share of an allgather.
    std::vector<char> ids(kNcclUniqueIdBytes * static_cast<size_t>(topo.size), 0);
    std::vector<char> mine(kNcclUniqueIdBytes, 0);
    std::string id_error;
    if (topo.rank == 0) {
      try {
        nccl_unique_id(mine.data());
      } catch (const Failure& e) {
        id_error = e.what();
        mine[0] = 1;  // the allgather below carries the failure to everyone
        std::memset(mine.data() + 1, 0xff, kNcclUniqueIdBytes - 1);
      }
    }
    host.allgather(mine.data(), ids.data(), kNcclUniqueIdBytes);
    int64_t failed = id_error.empty() ? 0 : 1;
    host.allreduce_int64(&failed, 1, ReduceOp::kMax);
    if (failed) fail(A2A_ERROR_TRANSPORT, "rank ", topo.rank, ": rank 0 could not create a NCCL unique id",
                     id_error.empty() ? std::string() : cat(": ", id_error));
    parts.data = parts.transports
                     .emplace_back(make_nccl_transport(ids.data(), topo.size, topo.rank, cuda_device_of(*device),
                                                       timeout_s))
                     .get();
  } else if (cuda || staging_test == "staged") {
    parts.data = parts.transports.emplace_back(std::make_unique<StagedTransport>(host, *device, timeout_s)).get();
  } else if (staging_test == "control") {
    parts.data = &host;
    parts.control = parts.transports.emplace_back(std::make_unique<DeviceControlTransport>(host, *device, timeout_s)).get();
    parts.control_waits_for_stream = true;
  } else {
    parts.data = &host;
  }
  parts.device = std::move(device);
  parts.device_type = config.device_type;
  parts.transport = config.transport;
  return std::make_unique<Comm>(std::move(parts), topo, use_datatypes != 0 && !cuda);
}

}  // namespace a2a
