#include "cpu/mpi_comm.hpp"

#include <climits>
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "cpu/cpu_device.hpp"
#include "cpu/mpi_transport.hpp"

namespace a2a {

namespace {

constexpr double kDefaultTimeoutS = 300.0;

// Reads a non-negative integer environment variable; -1 when unset.
long env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "environment variable ", name, "='", text, "' is not a non-negative integer");
  return value;
}

double timeout_from(const a2a_comm_config_t& config) {
  if (config.timeout_s > 0) return config.timeout_s;
  const char* text = std::getenv("A2A_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || value <= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_TIMEOUT_S='", text, "' is not a positive number of seconds");
  return value;
}

}  // namespace

std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) fail(A2A_ERROR_INVALID_ARGUMENT, "MPI is not initialized (import mpi4py or call MPI_Init first)");
  if (parent == MPI_COMM_NULL) fail(A2A_ERROR_INVALID_ARGUMENT, "the MPI communicator is MPI_COMM_NULL");
  // A bad setting on one rank must not leave the others waiting: settings
  // are read first, every rank makes the same collective calls, and the
  // verdict is shared at the end.
  std::string setting_error;
  auto setting = [&](auto read, auto fallback) -> decltype(fallback) {
    try {
      return read();
    } catch (const Failure& e) {
      if (setting_error.empty()) setting_error = e.what();
      return fallback;
    }
  };
  const double timeout_s = setting([&] { return timeout_from(config); }, kDefaultTimeoutS);
  const long env_local = setting([] { return env_int("A2A_LOCAL_SIZE"); }, -1L);
  const size_t max_count = setting([] { return max_int_count(); }, static_cast<size_t>(INT_MAX));
  int use_datatypes = config.use_mpi_datatypes;
  if (use_datatypes < 0) use_datatypes = setting([] { return env_int("A2A_MPI_DATATYPES"); }, -1L) == 0 ? 0 : 1;

  MPI_Comm dup;
  int rc = MPI_Comm_dup(parent, &dup);
  if (rc != MPI_SUCCESS) fail(A2A_ERROR_TRANSPORT, "MPI_Comm_dup failed with code ", rc);
  auto transport = std::make_unique<MpiTransport>(dup, timeout_s, max_count);
  const int rank = transport->rank(), size = transport->size();

  // Detection runs on every rank (it is collective) even where local_size is given.
  std::string irregular;
  const int detected = detect_local_size(dup, &irregular);
  int local_size = config.local_size > 0 ? config.local_size : static_cast<int>(env_local > 0 ? env_local : 0);
  const bool explicit_local = local_size > 0;
  if (explicit_local)
    irregular.clear();
  else
    local_size = detected;
  // A given local_size must be given, and equal, on every rank; detected
  // node sizes may differ (then only 2DH is refused).
  const int64_t given = explicit_local ? 1 : 0;
  int64_t bounds[5] = {setting_error.empty() ? 0 : 1, local_size, -static_cast<int64_t>(local_size), given, -given};
  transport->allreduce_int64(bounds, 5, ReduceOp::kMax);
  if (!setting_error.empty()) fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, ": ", setting_error);
  if (bounds[0] != 0)
    fail(A2A_ERROR_REMOTE, "rank ", rank, ": another rank rejected its settings while creating the communicator "
         "(see the error on that rank)");
  if (bounds[3] != -bounds[4])
    fail(A2A_ERROR_MISMATCH, "rank ", rank, ": local_size is given (local_size= / A2A_LOCAL_SIZE) on some ranks but "
         "not on others; this rank ", explicit_local ? "has " : "does not have ", "one");
  if (bounds[1] != -bounds[2]) {
    if (explicit_local)
      fail(A2A_ERROR_MISMATCH, "rank ", rank, ": local_size differs across ranks (from ", -bounds[2], " to ",
           bounds[1], "; this rank has ", local_size, " from local_size= / A2A_LOCAL_SIZE); pass the same local_size "
           "on every rank");
    // Nodes of different sizes: the comm works for linear algorithms.
    if (irregular.empty())
      irregular = cat("MPI shared-memory nodes have different sizes (from ", -bounds[2], " to ", bounds[1],
                      " ranks); pass local_size= or set A2A_LOCAL_SIZE");
    local_size = 1;
  }
  Topology topo;
  if (size % local_size == 0 && irregular.empty()) {
    topo = make_topology(rank, size, local_size);
  } else {
    // Still usable for linear algorithms; 2DH reports why it cannot run.
    topo.rank = rank;
    topo.size = size;
    topo.local_size = local_size;
    topo.local_rank = rank % local_size;
    topo.node = rank / local_size;
    topo.num_nodes = (size + local_size - 1) / local_size;
    topo.irregular_reason = irregular.empty()
                                ? cat("world size ", size, " is not divisible by local_size ", local_size,
                                      explicit_local ? " (from local_size= / A2A_LOCAL_SIZE)" : "")
                                : irregular;
  }
  return std::make_unique<Comm>(std::move(transport), std::make_unique<CpuDevice>(), topo, use_datatypes != 0);
}

}  // namespace a2a
