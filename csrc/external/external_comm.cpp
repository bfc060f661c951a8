#include "external/external_comm.hpp"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "core/debug.hpp"
#include "core/error.hpp"
#include "cpu/cpu_device.hpp"
#include "cpu/thread_pool.hpp"
#include "setup/agree_topology.hpp"
#include "setup/report.hpp"
#include "setup/settings.hpp"

namespace a2a {

namespace {

CommParts external_parts(const std::shared_ptr<ExternalChannel>& channel, const std::vector<int>& members, int rank,
                         int tag, double timeout_s, int local_size, bool cross_check, bool predict_checks);

class ExternalSplitter final : public Splitter {
 public:
  ExternalSplitter(ExternalTransport& control, bool cross_check, bool predict_checks)
      : control_(control), cross_check_(cross_check), predict_checks_(predict_checks) {}

  std::unique_ptr<Comm> split(Comm& parent, int color, const Topology& topology) override {
    std::optional<ChannelSplit> child = split_channel(parent, control_, color, topology);
    if (!child) return nullptr;
    auto comm = std::make_unique<Comm>(external_parts(control_.channel(), child->members, topology.rank, child->tag,
                                                      control_.timeout_s(), topology.local_size, cross_check_,
                                                      predict_checks_),
                                       topology, false);
    report_created(*comm, "a split", "the nodes of the communicator split", control_.timeout_s());
    return comm;
  }

 private:
  ExternalTransport& control_;
  bool cross_check_;
  bool predict_checks_;
};

// Two lanes: the data on `tag`, which completes the control lane's posted
// check before it waits; the check and the host values on tag + 1.
CommParts external_parts(const std::shared_ptr<ExternalChannel>& channel, const std::vector<int>& members, int rank,
                         int tag, double timeout_s, int local_size, bool cross_check, bool predict_checks) {
  auto data = std::make_unique<ExternalTransport>(channel, members, rank, tag, timeout_s);
  auto control = control_lane(channel, members, rank, tag, timeout_s);
  data->watch(control.get());
  CommParts parts;
  parts.cross_check = cross_check;
  parts.device = std::make_unique<CpuDevice>(cpu::threads_per_rank(local_size));
  parts.device_type = A2A_DEVICE_CPU;
  parts.transport = A2A_TRANSPORT_EXTERNAL;
  // The channel labels nothing: the check of a call that every rank
  // predicted rides beside its data instead of a round before it.
  parts.predicts_check = predict_checks;
  parts.splitter = std::make_unique<ExternalSplitter>(*control, cross_check, predict_checks);
  parts.data = parts.transports.emplace_back(std::move(data)).get();
  parts.control = parts.transports.emplace_back(std::move(control)).get();
  return parts;
}

}  // namespace

std::shared_ptr<ExternalChannel> open_channel(const a2a_transport_ops_t& ops) {
  // The channel owns ops from here: its destructor releases them, on failure too.
  auto channel = std::make_shared<ExternalChannel>(ops);
  if (ops.isend == nullptr || ops.irecv == nullptr || ops.wait == nullptr)
    fail(A2A_ERROR_INVALID_ARGUMENT, "a2a_transport_ops_t: isend, irecv and wait must not be NULL");
  return channel;
}

std::vector<int> channel_ranks(int size) {
  std::vector<int> members(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) members[static_cast<size_t>(r)] = r;
  return members;
}

std::unique_ptr<ExternalTransport> control_lane(std::shared_ptr<ExternalChannel> channel, std::vector<int> members,
                                                int rank, int tag, double timeout_s) {
  return std::make_unique<ExternalTransport>(std::move(channel), std::move(members), rank, tag + 1, timeout_s);
}

std::optional<ChannelSplit> split_channel(Comm& parent, ExternalTransport& lane, int color, const Topology& topology) {
  struct Entry {
    int color, key, next_tag;
  };
  const Entry mine{color, topology.rank, lane.channel()->next_tag()};  // topology.rank: the new rank
  std::vector<Entry> entries(parent.size());
  parent.control().allgather(&mine, entries.data(), sizeof(Entry));
  int tag = 0;
  for (const Entry& e : entries) tag = std::max(tag, e.next_tag);
  lane.channel()->take_tag(tag);
  if (color == A2A_UNDEFINED) return std::nullopt;
  std::vector<std::pair<int, int>> ranked;  // (new rank, parent rank)
  for (int r = 0; r < parent.size(); ++r)
    if (entries[r].color == color) ranked.emplace_back(entries[r].key, r);
  std::sort(ranked.begin(), ranked.end());
  ChannelSplit child{{}, tag};
  for (const auto& [new_rank, parent_rank] : ranked) child.members.push_back(lane.members()[parent_rank]);
  if (static_cast<int>(child.members.size()) != topology.size)
    fail(A2A_ERROR_INTERNAL, "rank ", parent.rank(), ": the split found ", child.members.size(), " ranks of color ",
         color, " where ", topology.size, " were expected");
  return child;
}

std::unique_ptr<Comm> create_external_comm(const a2a_transport_ops_t& ops, int size, int rank,
                                           const a2a_comm_config_t& config, bool predict_checks) {
  std::shared_ptr<ExternalChannel> channel = open_channel(ops);
  if (size < 1 || rank < 0 || rank >= size)
    fail(A2A_ERROR_INVALID_ARGUMENT, "rank ", rank, " is not in [0, size=", size, ")");
  SettingReader settings;
  debug::set_level(settings.read([] { return debug::level_from_env(); }, debug::Level::kOff));
  const double timeout_s = settings.read([&] { return timeout_from(config); }, kDefaultTimeoutS);
  const LocalSizeProposal proposal = launcher_local_size(config, size, settings);
  a2a_comm_config_t kind = config;
  kind.device_type = A2A_DEVICE_CPU;
  kind.transport = A2A_TRANSPORT_EXTERNAL;
  kind.cross_check = settings.read([&] { return cross_check_from(config); }, true) ? 1 : 0;
  debug::set_rank(rank);

  const std::vector<int> members = channel_ranks(size);
  // Shares the setting errors of every rank, and the topology, over the
  // control lane of the communicator to be (tags 0 and 1).
  const Topology topo = agree_topology(*control_lane(channel, members, rank, 0, timeout_s), proposal, kind, settings);
  auto comm = std::make_unique<Comm>(
      external_parts(channel, members, rank, 0, timeout_s, topo.local_size, kind.cross_check == 1, predict_checks),
      topo, false);
  report_created(*comm, ops.name ? ops.name : "an external transport",
                 proposal.explicit_size ? proposal.source : "the default: one node", timeout_s);
  return comm;
}

}  // namespace a2a
