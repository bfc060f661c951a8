// Communicators over a caller's transport (a2a_comm_create_external): a host
// communicator whose data and control lanes are ExternalTransports over the
// caller's channel, and the control lane that a NCCL communicator made from a
// unique id may take beside NCCL (setup/nccl_comm.cpp). Splits map their
// ranks onto the same channel with tags of their own.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "a2a/a2a.h"
#include "core/comm.hpp"
#include "external/external_transport.hpp"

namespace a2a {

// Collective over the `size` ranks of ops. ops->release runs once the last
// communicator over ops is gone, or before a failure returns.
// predict_checks = false (tests only: a2a_testing_comm_create_external_by_round)
// checks every call by a round of its own, as before the predicted check.
std::unique_ptr<Comm> create_external_comm(const a2a_transport_ops_t& ops, int size, int rank,
                                           const a2a_comm_config_t& config, bool predict_checks = true);

// The channel over ops (a2a_comm_create_nccl_with_control's control), its
// callbacks checked; ops->release runs when the channel goes, on failure too.
std::shared_ptr<ExternalChannel> open_channel(const a2a_transport_ops_t& ops);

// The ranks on the channel of a communicator made from it directly: 0 .. size - 1.
std::vector<int> channel_ranks(int size);

// The lane that carries a communicator's argument check and host values over
// `channel` (ranks `members` on the channel, first tag `tag`).
std::unique_ptr<ExternalTransport> control_lane(std::shared_ptr<ExternalChannel> channel, std::vector<int> members,
                                                int rank, int tag, double timeout_s);

// A split of a communicator whose control lane is `lane`, collective over
// `parent` after Comm::split's agreement: every rank shares its color, its
// new rank and the channel's next free tag; the ranks of one color, in new
// rank order, take the largest tag. nullopt for color A2A_UNDEFINED.
struct ChannelSplit {
  std::vector<int> members;  // the new ranks' ranks on the channel
  int tag;
};
std::optional<ChannelSplit> split_channel(Comm& parent, ExternalTransport& lane, int color, const Topology& topology);

}  // namespace a2a
