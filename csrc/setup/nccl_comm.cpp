#include "setup/nccl_comm.hpp"

#include <utility>

#include "core/debug.hpp"
#include "core/error.hpp"
#include "core/staging.hpp"
#include "external/external_comm.hpp"
#include "setup/agree_topology.hpp"
#include "setup/backends.hpp"
#include "setup/report.hpp"
#include "setup/settings.hpp"

namespace a2a {

namespace {

// The parts of a communicator whose data goes over `nccl`; its control over
// `control` (a lane of the caller's channel) where given, else over NCCL
// through a device buffer. With the splitter that makes its sub-communicators alike.
CommParts nccl_parts(std::unique_ptr<Device> device, std::unique_ptr<Transport> nccl,
                     std::unique_ptr<ExternalTransport> control, double timeout_s, bool cross_check);

class NcclSplitter final : public Splitter {
 public:
  // nccl and control belong to the communicator that owns this splitter.
  NcclSplitter(Transport& nccl, ExternalTransport* control, int cuda_device, double timeout_s, bool cross_check)
      : nccl_(nccl), control_(control), cuda_device_(cuda_device), timeout_s_(timeout_s), cross_check_(cross_check) {}

  std::unique_ptr<Comm> split(Comm& parent, int color, const Topology& topology) override {
    // The channel's split first: it is an all-gather on the parent's control
    // lane, which ncclCommSplit's failure (aborting the parent) would take away.
    std::optional<ChannelSplit> lane;
    if (control_ != nullptr) lane = split_channel(parent, *control_, color, topology);
    std::unique_ptr<Transport> nccl = split_nccl_transport(nccl_, color, topology.rank);
    if (color == A2A_UNDEFINED) return nullptr;
    if (nccl == nullptr || nccl->rank() != topology.rank || nccl->size() != topology.size)
      fail(A2A_ERROR_INTERNAL, "rank ", parent.rank(), ": ncclCommSplit made rank ", nccl ? nccl->rank() : -1, " of ",
           nccl ? nccl->size() : 0, " where rank ", topology.rank, " of ", topology.size, " was expected");
    std::unique_ptr<ExternalTransport> control;
    if (lane) control = control_lane(control_->channel(), lane->members, topology.rank, lane->tag, timeout_s_);
    auto comm = std::make_unique<Comm>(
        nccl_parts(make_cuda_device(cuda_device_), std::move(nccl), std::move(control), timeout_s_, cross_check_),
        topology, false);
    report_created(*comm, "a split", "the nodes of the communicator split", timeout_s_);
    return comm;
  }

 private:
  Transport& nccl_;
  ExternalTransport* control_;
  int cuda_device_;
  double timeout_s_;
  bool cross_check_;
};

CommParts nccl_parts(std::unique_ptr<Device> device, std::unique_ptr<Transport> nccl,
                     std::unique_ptr<ExternalTransport> control, double timeout_s, bool cross_check) {
  CommParts parts;
  parts.cross_check = cross_check;
  parts.device = std::move(device);
  parts.device_type = A2A_DEVICE_CUDA;
  parts.transport = A2A_TRANSPORT_NCCL;
  parts.data = parts.transports.emplace_back(std::move(nccl)).get();
  ExternalTransport* const lane = control.get();
  if (control) {
    // As NCCL under MPI: a predicted call posts its check on the host
    // channel and enqueues its data at once.
    parts.control = parts.transports.emplace_back(std::move(control)).get();
    parts.predicts_check = true;
  } else {
    parts.control =
        parts.transports.emplace_back(std::make_unique<DeviceControlTransport>(*parts.data, *parts.device, timeout_s))
            .get();
    parts.control_waits_for_stream = true;
  }
  parts.splitter =
      std::make_unique<NcclSplitter>(*parts.data, lane, cuda_device_of(*parts.device), timeout_s, cross_check);
  return parts;
}

}  // namespace

std::unique_ptr<Comm> create_nccl_comm(const void* id, int size, int rank, const a2a_comm_config_t& config,
                                       const a2a_transport_ops_t* control) {
  // Owns control's ops from here: released on any failure below.
  const std::shared_ptr<ExternalChannel> channel = control ? open_channel(*control) : nullptr;
  if (id == nullptr) fail(A2A_ERROR_INVALID_ARGUMENT, "the NCCL unique id is NULL");
  if (size < 1 || rank < 0 || rank >= size)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, " is not in [0, size=", size, ")");
  // Settings that would fail on one rank only fail before NCCL's creation,
  // which the other ranks would otherwise wait for until the timeout.
  const double timeout_s = timeout_from(config);
  SettingReader settings;
  debug::set_level(settings.read([] { return debug::level_from_env(); }, debug::Level::kOff));
  const LocalSizeProposal proposal = launcher_local_size(config, size, settings);
  const bool cross_check = settings.read([&] { return cross_check_from(config); }, true);
  if (!settings.error().empty()) fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, ": ", settings.error());
  debug::set_rank(rank);

  a2a_comm_config_t kind = config;
  kind.device_type = A2A_DEVICE_CUDA;
  kind.transport = A2A_TRANSPORT_NCCL;
  kind.cross_check = cross_check ? 1 : 0;
  std::unique_ptr<Device> device = make_cuda_device(config.cuda_device);
  std::unique_ptr<Transport> nccl = make_nccl_transport(id, size, rank, cuda_device_of(*device), timeout_s);
  std::unique_ptr<ExternalTransport> lane;
  if (channel) lane = control_lane(channel, channel_ranks(size), rank, 0, timeout_s);
  CommParts parts = nccl_parts(std::move(device), std::move(nccl), std::move(lane), timeout_s, cross_check);
  const Topology topo = agree_topology(*parts.control, proposal, kind, SettingReader());
  auto comm = std::make_unique<Comm>(std::move(parts), topo, false);
  report_created(*comm, "a NCCL unique id", proposal.explicit_size ? proposal.source : "the default: one node",
                 timeout_s);
  return comm;
}

}  // namespace a2a
