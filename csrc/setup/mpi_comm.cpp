#include "setup/mpi_comm.hpp"

#include <climits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/debug.hpp"
#include "core/error.hpp"
#include "core/staging.hpp"
#include "cpu/cpu_device.hpp"
#include "cpu/mpi_transport.hpp"
#include "cpu/thread_pool.hpp"
#include "setup/agree_topology.hpp"
#include "setup/backends.hpp"
#include "setup/mpi_calls.hpp"
#include "setup/mpi_topology.hpp"
#include "setup/report.hpp"
#include "setup/settings.hpp"

namespace a2a {

namespace {

void check_choice(const a2a_comm_config_t& config) {
  if (config.device_type != A2A_DEVICE_CPU && config.device_type != A2A_DEVICE_CUDA)
    fail(A2A_ERROR_INVALID_ARGUMENT, "config.device_type ", config.device_type, " is neither CPU (0) nor CUDA (1)");
  if (config.transport != A2A_TRANSPORT_MPI && config.transport != A2A_TRANSPORT_NCCL)
    fail(A2A_ERROR_INVALID_ARGUMENT, "config.transport ", config.transport, " is neither MPI (0) nor NCCL (1)");
  if (config.transport == A2A_TRANSPORT_NCCL && config.device_type != A2A_DEVICE_CUDA)
    fail(A2A_ERROR_INVALID_ARGUMENT, "transport NCCL moves CUDA memory: it needs device_type CUDA");
}

// MPI's thread support for the process, as an a2a_mpi_thread_level_t.
int query_thread_level() {
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread", -1, "communicator creation");
  if (provided == MPI_THREAD_MULTIPLE) return A2A_MPI_THREAD_MULTIPLE;
  if (provided == MPI_THREAD_SERIALIZED) return A2A_MPI_THREAD_SERIALIZED;
  if (provided == MPI_THREAD_FUNNELED) return A2A_MPI_THREAD_FUNNELED;
  return A2A_MPI_THREAD_SINGLE;
}

// A duplicate of `parent`, so that the library's messages never meet the
// caller's: MPI_Comm_idup, bounded by the timeout. (Errors on `parent` go to
// the caller's error handler, by default MPI_ERRORS_ARE_FATAL.)
MPI_Comm duplicate(MPI_Comm parent, double timeout_s) {
  const char* what = "communicator creation";
  int rank = -1, size = 1;
  check_mpi(MPI_Comm_rank(parent, &rank), "MPI_Comm_rank", rank, what);
  check_mpi(MPI_Comm_size(parent, &size), "MPI_Comm_size", rank, what);
  auto dup = std::make_unique<MPI_Comm>(MPI_COMM_NULL);  // written when the duplication completes
  MPI_Request request;
  check_mpi(MPI_Comm_idup(parent, dup.get(), &request), "MPI_Comm_idup", rank, what);
  wait_mpi(request, "MPI_Comm_idup", rank, size, timeout_s, what, dup);
  return *dup;
}

// What a communicator over MPI was made with, so that its splits are made
// alike (Comm::split).
struct MpiRecipe {
  int device_type;      // a2a_device_type_t
  int transport;        // a2a_transport_t
  int cuda_device;      // the CUDA ordinal of the device; -1 on the CPU
  int cpu_threads;      // copy threads of a host device
  double timeout_s;
  size_t max_count;     // A2A_MPI_MAX_COUNT
  bool use_datatypes;
  int thread_level;     // a2a_mpi_thread_level_t
  HostArrangement arrange;
  bool cross_check;     // a2a_comm_config_t.cross_check, resolved
};

std::unique_ptr<Comm> assemble(std::unique_ptr<MpiTransport> mpi, std::unique_ptr<Device> device,
                               std::unique_ptr<Transport> nccl, const Topology& topo, const MpiRecipe& recipe);

// Splits the MPI duplicate (and the NCCL communicator, if any) of a
// communicator made over MPI.
class MpiSplitter final : public Splitter {
 public:
  // mpi and nccl belong to the communicator that owns this splitter.
  MpiSplitter(MpiRecipe recipe, MpiTransport& mpi, Transport* nccl)
      : recipe_(std::move(recipe)), mpi_(mpi), nccl_(nccl) {}

  std::unique_ptr<Comm> split(Comm& parent, int color, const Topology& topology) override {
    const bool joins = color != A2A_UNDEFINED;
    // Blocking (MPI has no nonblocking split), but every rank is known to be
    // here: Comm::split's allgather just completed on all of them.
    MPI_Comm split_comm = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(mpi_.mpi_comm(), joins ? color : MPI_UNDEFINED, topology.rank, &split_comm),
              "MPI_Comm_split", parent.rank(), "split");
    std::unique_ptr<MpiTransport> mpi;
    if (split_comm != MPI_COMM_NULL)
      mpi = std::make_unique<MpiTransport>(split_comm, recipe_.timeout_s, recipe_.max_count);
    std::unique_ptr<Transport> nccl;
    if (nccl_ != nullptr) nccl = split_nccl_transport(*nccl_, color, topology.rank);
    if (!joins) return nullptr;
    if (mpi == nullptr || mpi->rank() != topology.rank || mpi->size() != topology.size)
      fail(A2A_ERROR_INTERNAL, "rank ", parent.rank(), ": MPI_Comm_split made rank ", mpi ? mpi->rank() : -1, " of ",
           mpi ? mpi->size() : 0, " where rank ", topology.rank, " of ", topology.size, " was expected");
    std::unique_ptr<Device> device;
    if (recipe_.device_type == A2A_DEVICE_CUDA)
      device = make_cuda_device(recipe_.cuda_device);
    else
      device = std::make_unique<CpuDevice>(recipe_.cpu_threads);
    auto comm = assemble(std::move(mpi), std::move(device), std::move(nccl), topology, recipe_);
    report_created(*comm, "a split", "the nodes of the communicator split", recipe_.timeout_s,
                   cat(", ", mpi_thread_level_name(recipe_.thread_level)));
    return comm;
  }

 private:
  MpiRecipe recipe_;
  MpiTransport& mpi_;
  Transport* nccl_;
};

// The communicator around its MPI transport: host memory over MPI, CUDA
// memory over NCCL (`nccl`) or staged through host memory, or the test-only
// arrangement.
std::unique_ptr<Comm> assemble(std::unique_ptr<MpiTransport> mpi, std::unique_ptr<Device> device,
                               std::unique_ptr<Transport> nccl, const Topology& topo, const MpiRecipe& recipe) {
  MpiTransport& host = *mpi;
  Transport* const nccl_transport = nccl.get();
  const bool cuda = recipe.device_type == A2A_DEVICE_CUDA;
  CommParts parts;
  parts.device = std::move(device);
  parts.device_type = recipe.device_type;
  parts.transport = recipe.transport;
  parts.data = parts.control = mpi.get();
  parts.transports.push_back(std::move(mpi));
  if (nccl) {
    parts.data = parts.transports.emplace_back(std::move(nccl)).get();
    // NCCL returns before the data moved: a predicted call posts its check
    // on MPI instead of waiting for a round.
    parts.predicts_check = true;
  } else if (cuda) {
    parts.data =
        parts.transports.emplace_back(std::make_unique<StagedTransport>(host, *parts.device, recipe.timeout_s)).get();
  } else if (recipe.arrange) {
    recipe.arrange(parts, recipe.timeout_s);
  }
  parts.splitter = std::make_unique<MpiSplitter>(recipe, host, nccl_transport);
  parts.cross_check = recipe.cross_check;
  auto comm = std::make_unique<Comm>(std::move(parts), topo, recipe.use_datatypes && !cuda);
  comm->call_gate().set_mpi_thread_level(recipe.thread_level);
  return comm;
}

}  // namespace

std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config) {
  return create_mpi_comm(parent, config, HostArrangement());
}

std::unique_ptr<Comm> create_mpi_comm(MPI_Comm parent, const a2a_comm_config_t& config, const HostArrangement& arrange) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized", -1, "communicator creation");
  if (!initialized) fail(A2A_ERROR_INVALID_ARGUMENT, "MPI is not initialized (import mpi4py or call MPI_Init first)");
  if (parent == MPI_COMM_NULL) fail(A2A_ERROR_INVALID_ARGUMENT, "the MPI communicator is MPI_COMM_NULL");
  // A bad setting on one rank must not leave the others waiting: settings
  // are read first, every rank makes the same collective calls, and the
  // verdict is shared in agree_topology.
  SettingReader settings;
  debug::set_level(settings.read([] { return debug::level_from_env(); }, debug::Level::kOff));
  const double timeout_s = settings.read([&] { return timeout_from(config); }, kDefaultTimeoutS);
  const long env_local = settings.read([] { return env_int("A2A_LOCAL_SIZE"); }, -1L);
  const size_t max_count = settings.read([] { return max_int_count(); }, static_cast<size_t>(INT_MAX));
  int use_datatypes = config.use_mpi_datatypes;
  if (use_datatypes < 0) use_datatypes = settings.read([] { return env_int("A2A_MPI_DATATYPES"); }, -1L) == 0 ? 0 : 1;
  settings.read([&] { check_choice(config); return 0; }, 0);
  a2a_comm_config_t agreed = config;  // the settings every rank must share, resolved
  agreed.cross_check = settings.read([&] { return cross_check_from(config); }, true) ? 1 : 0;
  const bool cuda = config.device_type == A2A_DEVICE_CUDA;
  // The device comes first: a bad ordinal or a build without CUDA is a
  // setting error, shared before any rank waits in NCCL's creation.
  std::unique_ptr<Device> device;
  if (cuda)
    device = settings.read([&] { return make_cuda_device(config.cuda_device); }, std::unique_ptr<Device>());

  auto mpi = std::make_unique<MpiTransport>(duplicate(parent, timeout_s), timeout_s, max_count);
  const MPI_Comm dup = mpi->mpi_comm();
  int world_rank = 0;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &world_rank) == MPI_SUCCESS) debug::set_rank(world_rank);

  // Detection runs on every rank (it is collective) even where local_size is given.
  LocalSizeProposal proposal;
  proposal.local_size = detect_local_size(dup, timeout_s, &proposal.irregular_reason);
  // The host's cores shared among the ranks on it (measured in
  // docs/benchmarks.md: more copy threads than cores only slowed copies).
  const int cpu_threads = cuda ? 0 : cpu::threads_per_rank(proposal.local_size);
  if (!cuda) device = std::make_unique<CpuDevice>(cpu_threads);
  proposal.source = "local_size= / A2A_LOCAL_SIZE";
  const int given = config.local_size > 0 ? config.local_size : static_cast<int>(env_local > 0 ? env_local : 0);
  if (given > 0) {
    proposal.local_size = given;
    proposal.explicit_size = true;
    proposal.irregular_reason.clear();
  }
  // The agreement is the first MPI collective on the duplicate: an MPI that refuses the communicator
  // (an intercommunicator whose node detection passed) fails here; name the step and the rank.
  const Topology topo = [&] {
    try {
      return agree_topology(*mpi, proposal, agreed, settings);
    } catch (const Failure& e) {
      int rank = -1;
      MPI_Comm_rank(dup, &rank);
      throw Failure(e.status(), cat("rank ", rank, ": communicator creation (the topology agreement): ", e.what()));
    }
  }();

  std::unique_ptr<Transport> nccl;
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
    mpi->allgather(mine.data(), ids.data(), kNcclUniqueIdBytes);
    int64_t failed = id_error.empty() ? 0 : 1;
    mpi->allreduce_int64(&failed, 1, ReduceOp::kMax);
    if (failed) fail(A2A_ERROR_TRANSPORT, "rank ", topo.rank, ": rank 0 could not create a NCCL unique id",
                     id_error.empty() ? std::string() : cat(": ", id_error));
    nccl = make_nccl_transport(ids.data(), topo.size, topo.rank, cuda_device_of(*device), timeout_s);
  }
  const MpiRecipe recipe{config.device_type, config.transport, cuda ? cuda_device_of(*device) : -1, cpu_threads,
                         timeout_s, max_count, use_datatypes != 0, query_thread_level(), arrange,
                         agreed.cross_check == 1};
  auto comm = assemble(std::move(mpi), std::move(device), std::move(nccl), topo, recipe);
  report_created(*comm, "MPI",
                 !proposal.explicit_size ? "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)"
                 : config.local_size > 0 ? "local_size="
                                         : "A2A_LOCAL_SIZE",
                 timeout_s, cat(", ", mpi_thread_level_name(recipe.thread_level)));
  return comm;
}

}  // namespace a2a
