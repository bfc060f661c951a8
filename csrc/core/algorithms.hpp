// The all-to-all algorithms, written once against Transport + Device.
// Arguments are assumed valid and agreed across ranks (see collectives.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

PeerGroup world_group(const Topology& topo);
PeerGroup node_group(const Topology& topo);  // my node's ranks, indexed by local_rank
PeerGroup rail_group(const Topology& topo);  // my local_rank on every node, indexed by node

// One all-to-all exchange inside `group`: member i receives recv_span(j) from
// member j and sends send_span(i) to every member i. Peers are visited in the
// shifted order me+1, me+2, ... so that not every rank starts at rank 0.
void exchange(Transport& transport, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span);
// `pieces` messages to and from every member, piece k of one pair after
// piece k - 1 (the flexible all-to-all's "pieces" path).
void exchange_pieces(Transport& transport, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece);

// A group of one member (one rank, or one rank per node): its pieces are
// copied on `device`, stream-ordered, instead of sent to itself through a
// transport (a NCCL self send costs a group launch on the host, the staged
// transport a round trip through host memory and a wait for the stream, MPI
// a match). The spans are the data transport's, in the device's memory: the
// control path's host spans (digests, counts) keep their transport. False,
// and nothing done, for a larger group or spans whose blocks the device's
// copies cannot pair (both strided, of different blocks).
bool copy_own_pieces(Device& device, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece);

// An algorithm's exchanges go over the comm's data transport and carry the
// call's cross-rank check where it travels in band (check non-null:
// Comm::exchange_in_band); nullptr means agree() already ran, or the check
// is off. Algorithms take the pointer and pass it to every exchange they run.
void exchange(Comm& comm, InBandCheck* check, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span);
void exchange_pieces(Comm& comm, InBandCheck* check, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece);

// Uniform all-to-all of chunk_bytes per peer.
void all_to_all_linear(Comm& comm, const void* send, void* recv, size_t chunk_bytes,
                       InBandCheck* check = nullptr);
void all_to_all_2dh(Comm& comm, const void* send, void* recv, size_t chunk_bytes, void* workspace,
                    InBandCheck* check = nullptr);
size_t all_to_all_2dh_workspace(const Topology& topo, size_t chunk_bytes);

// The flexible all-to-all's geometry: the input is viewed as
// [outer, world, inner] blocks on the split side, the output as
// [outer_out, world, inner_out] on the concat side (bytes for inner).
struct FlexLayout {
  size_t split_outer;   // prod(shape[:split_axis])
  size_t split_inner;   // shape[split_axis] / world * prod(shape[split_axis+1:]) * itemsize
  size_t concat_outer;  // prod(chunk_shape[:concat_axis])
  size_t concat_inner;  // chunk_shape[concat_axis] * prod(chunk_shape[concat_axis+1:]) * itemsize
  size_t chunk_bytes() const { return split_outer * split_inner; }
};

// How the flexible all-to-all moves a layout (docs/algorithms.md compares
// them; choose_flex_path says when each is used):
//   contiguous  both sides are one block per peer: the uniform all-to-all
//   datatypes   strided spans straight to the transport (MPI derived datatypes)
//   pieces      several contiguous messages per peer, one per stretch that is
//               contiguous on both sides: no copy, no datatype
//   packed      transpose into a workspace, uniform all-to-all, transpose back
enum class FlexPath { kContiguous = 0, kDatatypes = 1, kPieces = 2, kPacked = 3 };
const char* flex_path_name(FlexPath path);
// The same on every rank for the same (agreed) arguments. A2A_FLEX_PATH
// (datatypes, pieces or packed) overrides the choice where that path applies.
FlexPath choose_flex_path(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo);
// Why A2A_FLEX_PATH cannot be used (an unknown value; choose_flex_path then
// ignores it), or "".
std::string flex_path_setting_error();

size_t all_to_all_flex_workspace(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo);
void all_to_all_flex(Comm& comm, const void* send, void* recv, const FlexLayout& layout, a2a_algo_t algo,
                     void* workspace, InBandCheck* check = nullptr);

// Uneven all-to-all. Counts are in bytes, one entry per rank; blocks are
// packed in rank order on both sides.
struct VCounts {
  std::vector<int64_t> send;   // bytes to each rank
  std::vector<int64_t> recv;   // bytes from each rank
  std::vector<int64_t> relay;  // 2DH only: [local peer][node] bytes that local peer sends to (node, my local_rank)
};

size_t all_to_all_v_2dh_workspace(const Topology& topo, const VCounts& counts);
void all_to_all_v_linear(Comm& comm, const void* send, void* recv, const VCounts& counts,
                         InBandCheck* check = nullptr);
void all_to_all_v_2dh(Comm& comm, const void* send, void* recv, const VCounts& counts, void* workspace,
                      InBandCheck* check = nullptr);
// Every rank's block of block_bytes, gathered in rank order (the dense
// all_gather as one exchange over the world, so that it carries the check).
void all_gather_exchange(Comm& comm, const void* send, void* recv, size_t block_bytes, InBandCheck* check);
// The same with blocks of bytes[r] bytes, packed in rank order.
void all_gather_v_exchange(Comm& comm, const void* send, void* recv, const std::vector<size_t>& bytes,
                           InBandCheck* check);

}  // namespace a2a
