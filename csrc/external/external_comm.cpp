#include "external/external_comm.hpp"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "core/debug.hpp"
#include "core/error.hpp"
#include "cpu/cpu_device.hpp"
#include "cpu/thread_pool.hpp"
#include "external/external_transport.hpp"
#include "setup/agree_topology.hpp"
#include "setup/report.hpp"
#include "setup/settings.hpp"

namespace a2a {

namespace {

CommParts external_parts(std::unique_ptr<ExternalTransport> transport, int local_size, bool cross_check);

// A split maps the new ranks onto the channel's: every rank of the parent
// shares its color, key and next free tag; the ranks of one color, ordered by
// (key, parent rank) as Comm::split's topology is, use the largest tag.
class ExternalSplitter final : public Splitter {
 public:
  ExternalSplitter(ExternalTransport& parent, bool cross_check) : parent_(parent), cross_check_(cross_check) {}

  std::unique_ptr<Comm> split(Comm& parent, int color, const Topology& topology) override {
    struct Entry {
      int color, key, next_tag;
    };
    const Entry mine{color, topology.rank, parent_.channel()->next_tag()};  // topology.rank: the new rank
    std::vector<Entry> entries(parent.size());
    parent.control().allgather(&mine, entries.data(), sizeof(Entry));
    int tag = 0;
    for (const Entry& e : entries) tag = std::max(tag, e.next_tag);
    parent_.channel()->take_tag(tag);
    if (color == A2A_UNDEFINED) return nullptr;
    std::vector<std::pair<int, int>> ranked;  // (new rank, parent rank)
    for (int r = 0; r < parent.size(); ++r)
      if (entries[r].color == color) ranked.emplace_back(entries[r].key, r);
    std::sort(ranked.begin(), ranked.end());
    std::vector<int> members;
    for (const auto& [new_rank, parent_rank] : ranked) members.push_back(parent_.members()[parent_rank]);
    if (static_cast<int>(members.size()) != topology.size)
      fail(A2A_ERROR_INTERNAL, "rank ", parent.rank(), ": the split found ", members.size(), " ranks of color ",
           color, " where ", topology.size, " were expected");
    auto transport = std::make_unique<ExternalTransport>(parent_.channel(), std::move(members), topology.rank, tag,
                                                         parent_.timeout_s());
    auto comm = std::make_unique<Comm>(external_parts(std::move(transport), topology.local_size, cross_check_),
                                       topology, false);
    report_created(*comm, "a split", "the nodes of the communicator split", parent_.timeout_s());
    return comm;
  }

 private:
  ExternalTransport& parent_;
  bool cross_check_;
};

CommParts external_parts(std::unique_ptr<ExternalTransport> transport, int local_size, bool cross_check) {
  CommParts parts;
  parts.cross_check = cross_check;
  parts.device = std::make_unique<CpuDevice>(cpu::threads_per_rank(local_size));
  parts.device_type = A2A_DEVICE_CPU;
  parts.transport = A2A_TRANSPORT_EXTERNAL;
  parts.splitter = std::make_unique<ExternalSplitter>(*transport, cross_check);
  parts.data = parts.control = parts.transports.emplace_back(std::move(transport)).get();
  return parts;
}

}  // namespace

std::unique_ptr<Comm> create_external_comm(const a2a_transport_ops_t& ops, int size, int rank,
                                           const a2a_comm_config_t& config) {
  // The channel owns ops from here: its destructor releases them, on failure too.
  auto channel = std::make_shared<ExternalChannel>(ops);
  if (ops.isend == nullptr || ops.irecv == nullptr || ops.wait == nullptr)
    fail(A2A_ERROR_INVALID_ARGUMENT, "a2a_transport_ops_t: isend, irecv and wait must not be NULL");
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

  std::vector<int> members(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) members[static_cast<size_t>(r)] = r;
  auto transport = std::make_unique<ExternalTransport>(channel, std::move(members), rank, 0, timeout_s);
  // Shares the setting errors of every rank, and the topology.
  const Topology topo = agree_topology(*transport, proposal, kind, settings);
  auto comm = std::make_unique<Comm>(external_parts(std::move(transport), topo.local_size, kind.cross_check == 1),
                                     topo, false);
  report_created(*comm, ops.name ? ops.name : "an external transport",
                 proposal.explicit_size ? proposal.source : "the default: one node", timeout_s);
  return comm;
}

}  // namespace a2a
