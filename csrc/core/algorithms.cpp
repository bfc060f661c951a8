#include "core/algorithms.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace a2a {

PeerGroup world_group(const Topology& topo) { return PeerGroup{0, 1, topo.size, topo.rank}; }
PeerGroup node_group(const Topology& topo) {
  return PeerGroup{topo.node * topo.local_size, 1, topo.local_size, topo.local_rank};
}
PeerGroup rail_group(const Topology& topo) {
  return PeerGroup{topo.local_rank, topo.local_size, topo.num_nodes, topo.node};
}

void exchange(Comm& comm, InBandCheck* check, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span) {
  exchange_pieces(
      comm, check, group, 1, [&](int i, size_t) { return send_span(i); }, [&](int j, size_t) { return recv_span(j); });
}

bool copy_own_pieces(Device& device, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece) {
  if (group.count != 1) return false;
  std::vector<std::pair<Span, Span>> spans;
  for (size_t k = 0; k < pieces; ++k) {
    const Span from = send_piece(0, k), to = recv_piece(0, k);
    if (from.bytes() != to.bytes())
      fail(A2A_ERROR_INTERNAL, "an exchange within one rank sends ", from.bytes(), " B of piece ", k, " and receives ",
           to.bytes(), " B");
    if (!from.is_contiguous() && !to.is_contiguous() && from.block_bytes != to.block_bytes) return false;
    spans.emplace_back(from, to);
  }
  for (const auto& [from, to] : spans) {
    if (from.bytes() == 0 || from.data == to.data) continue;
    if (from.is_contiguous() && to.is_contiguous()) {
      device.copy(to.data, from.data, from.bytes());
      continue;
    }
    // One range per block of the strided side; a contiguous side steps by that block.
    const size_t block = from.is_contiguous() ? to.block_bytes : from.block_bytes;
    const size_t from_step = from.is_contiguous() ? block : from.stride_bytes;
    const size_t to_step = to.is_contiguous() ? block : to.stride_bytes;
    std::vector<CopyRange> ranges(from.bytes() / block);
    for (size_t i = 0; i < ranges.size(); ++i) ranges[i] = CopyRange{i * from_step, i * to_step, block};
    device.copy_ranges(to.data, from.data, ranges.data(), ranges.size());
  }
  return true;
}

void exchange_pieces(Comm& comm, InBandCheck* check, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece) {
  if (check == nullptr && copy_own_pieces(comm.device(), group, pieces, send_piece, recv_piece)) return;
  if (check != nullptr)
    comm.exchange_in_band(*check, comm.transport(), group, pieces, send_piece, recv_piece);
  else
    exchange_pieces(comm.transport(), group, pieces, send_piece, recv_piece);
}

void exchange(Transport& transport, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span) {
  exchange_pieces(
      transport, group, 1, [&](int i, size_t) { return send_span(i); }, [&](int j, size_t) { return recv_span(j); });
}

void exchange_pieces(Transport& transport, const PeerGroup& group, size_t pieces,
                     const std::function<Span(int, size_t)>& send_piece,
                     const std::function<Span(int, size_t)>& recv_piece) {
  if (pieces == 0) return;
  transport.group_start();
  try {
    // Receives first, so that arriving messages find a posted buffer. Per
    // peer, pieces in order on both sides: the transport matches the
    // messages of one pair in the order they were posted.
    for (int step = 0; step < group.count; ++step) {
      const int from = (group.me - step + group.count) % group.count;
      for (size_t k = 0; k < pieces; ++k) transport.recv(recv_piece(from, k), group.member(from));
    }
    for (int step = 0; step < group.count; ++step) {
      const int to = (group.me + step) % group.count;
      for (size_t k = 0; k < pieces; ++k) transport.send(send_piece(to, k), group.member(to));
    }
  } catch (...) {
    transport.cancel_group();
    throw;
  }
  transport.group_end();
}

// ---------------------------------------------------------------------------
// Uniform all-to-all

void all_to_all_linear(Comm& comm, const void* send, void* recv, size_t chunk_bytes, InBandCheck* check) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  exchange(
      comm, check, world_group(comm.topology()), [&](int i) { return Span::contiguous(in + i * chunk_bytes, chunk_bytes); },
      [&](int j) { return Span::contiguous(out + j * chunk_bytes, chunk_bytes); });
}

size_t all_to_all_2dh_workspace(const Topology& topo, size_t chunk_bytes) {
  // One node or one rank per node: 2DH is the linear exchange (no copies).
  if (topo.num_nodes == 1 || topo.local_size == 1) return 0;
  return chunk_bytes * static_cast<size_t>(topo.size);
}

// Tutel Algorithm 2. With N nodes of L ranks, chunk (m, l) of a buffer is the
// chunk for/from rank m * L + l. Layouts, as grids of chunks:
//   send        [N][L]  chunk for (node m, local l)
//   phase 1     ws   [L][N]  = transpose(send): what local peer l forwards to each node
//   phase 2     recv [L][N]  row l'' received from local peer l'': its data for (m, my l)
//   phase 3     ws   [N][L]  = transpose(recv): row m goes to (node m, my l)
//   phase 4     recv [N][L]  row m received from (node m, my l): data of ranks (m, l'')
// The final layout is ordered by source rank m * L + l'', as MPI_Alltoall's.
//
// With the check in band, both exchanges carry it: the node's ranks agree in
// phase 2, the rail's in phase 4, and a rank that disagrees with a node peer
// ends the call before phase 4 with a notice to every rank, so that its rail
// peers (and everyone) learn of it too.
void all_to_all_2dh(Comm& comm, const void* send, void* recv, size_t chunk_bytes, void* workspace,
                    InBandCheck* check) {
  const Topology& topo = comm.topology();
  if (topo.num_nodes == 1 || topo.local_size == 1) {
    all_to_all_linear(comm, send, recv, chunk_bytes, check);
    return;
  }
  const size_t nodes = topo.num_nodes, locals = topo.local_size;
  char* ws = static_cast<char*>(workspace);
  char* out = static_cast<char*>(recv);
  const size_t row_to_local = nodes * chunk_bytes;  // one row of the [L][N] grid
  const size_t row_to_node = locals * chunk_bytes;  // one row of the [N][L] grid

  comm.device().transpose_chunks(ws, send, nodes, locals, chunk_bytes);
  exchange(
      comm, check, node_group(topo), [&](int l) { return Span::contiguous(ws + l * row_to_local, row_to_local); },
      [&](int l) { return Span::contiguous(out + l * row_to_local, row_to_local); });
  comm.device().transpose_chunks(ws, out, locals, nodes, chunk_bytes);
  exchange(
      comm, check, rail_group(topo), [&](int m) { return Span::contiguous(ws + m * row_to_node, row_to_node); },
      [&](int m) { return Span::contiguous(out + m * row_to_node, row_to_node); });
}

// ---------------------------------------------------------------------------
// Flexible all-to-all
//
// Send side: the input is [split_outer][world][split_inner]; rank i gets the
// column [:, i, :], which is strided unless split_outer == 1.
// Receive side: the output is [concat_outer][world][concat_inner]; rank j's
// chunk fills [:, j, :]. The bytes between one rank and one peer are a stream
// of chunk_bytes, cut into split_inner blocks on the send side and into
// concat_inner blocks on the receive side.

namespace {

constexpr size_t kMaxBlocks = static_cast<size_t>(std::numeric_limits<int>::max());
// Pieces: at least this many bytes each (below, a message's fixed cost beats
// the copy that packing would make) and at most this many per peer. Measured
// in docs/benchmarks.md ("flexible all-to-all paths").
constexpr size_t kMinPieceBytes = 64 * 1024;
constexpr size_t kMaxPiecesPerPeer = 64;
// Datatypes rather than packing from this many bytes per peer.
constexpr size_t kMinDatatypeChunkBytes = 64 * 1024;

// The stream's pieces: both inner sizes are products of trailing dimensions
// (times the item size), so the smaller divides the larger, and pieces of the
// smaller size are contiguous on both sides.
size_t piece_bytes(const FlexLayout& layout) { return std::min(layout.split_inner, layout.concat_inner); }

// Pieces when there are few enough and each is large enough.
bool pieces_fit(const FlexLayout& layout) {
  const size_t piece = piece_bytes(layout);
  return piece >= kMinPieceBytes && layout.chunk_bytes() / piece <= kMaxPiecesPerPeer;
}

constexpr int kAutoPath = -1, kBadPathSetting = -2;

// A2A_FLEX_PATH, read once: a FlexPath, kAutoPath when unset, kBadPathSetting
// for anything else (flex_path_setting_error reports it, through the
// argument check, so that every rank hears of it).
int flex_path_override() {
  static const int path = [] {
    const char* text = std::getenv("A2A_FLEX_PATH");
    const std::string value = text == nullptr ? "" : text;
    if (value.empty() || value == "auto") return kAutoPath;
    for (int p = static_cast<int>(FlexPath::kDatatypes); p <= static_cast<int>(FlexPath::kPacked); ++p)
      if (value == flex_path_name(static_cast<FlexPath>(p))) return p;
    return kBadPathSetting;
  }();
  return path;
}

}  // namespace

const char* flex_path_name(FlexPath path) {
  switch (path) {
    case FlexPath::kContiguous: return "contiguous";
    case FlexPath::kDatatypes: return "datatypes";
    case FlexPath::kPieces: return "pieces";
    case FlexPath::kPacked: return "packed";
  }
  return "unknown";
}

std::string flex_path_setting_error() {
  if (flex_path_override() != kBadPathSetting) return "";
  return cat("A2A_FLEX_PATH='", std::getenv("A2A_FLEX_PATH"), "' is not auto, datatypes, pieces or packed");
}

FlexPath choose_flex_path(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo) {
  // Nothing to move, or one block per peer on both sides.
  if (layout.chunk_bytes() == 0 || (layout.split_outer <= 1 && layout.concat_outer <= 1)) return FlexPath::kContiguous;
  if (algo != A2A_ALGO_LINEAR) return FlexPath::kPacked;  // 2DH regroups whole chunks
  const bool datatypes = comm.strided_spans() && layout.split_outer <= kMaxBlocks && layout.concat_outer <= kMaxBlocks;
  switch (flex_path_override()) {
    case static_cast<int>(FlexPath::kDatatypes):
      if (datatypes) return FlexPath::kDatatypes;
      break;
    case static_cast<int>(FlexPath::kPieces): return FlexPath::kPieces;
    case static_cast<int>(FlexPath::kPacked): return FlexPath::kPacked;
    default: break;
  }
  if (pieces_fit(layout)) return FlexPath::kPieces;
  // Many small blocks: MPI walks them itself faster than a pack and an
  // unpack when a peer's chunk is large; small exchanges are latency-bound,
  // and a datatype's setup costs more than the copies.
  if (datatypes && layout.chunk_bytes() >= kMinDatatypeChunkBytes) return FlexPath::kDatatypes;
  return FlexPath::kPacked;
}

size_t all_to_all_flex_workspace(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo) {
  const Topology& topo = comm.topology();
  const FlexPath path = choose_flex_path(comm, layout, algo);
  if (path == FlexPath::kContiguous && algo == A2A_ALGO_2DH) return all_to_all_2dh_workspace(topo, layout.chunk_bytes());
  if (path != FlexPath::kPacked) return 0;
  const size_t total = layout.chunk_bytes() * topo.size;
  size_t bytes = (layout.split_outer > 1 ? total : 0) + (layout.concat_outer > 1 ? total : 0);
  if (algo == A2A_ALGO_2DH) bytes += all_to_all_2dh_workspace(topo, layout.chunk_bytes());
  return bytes;
}

void all_to_all_flex(Comm& comm, const void* send, void* recv, const FlexLayout& layout, a2a_algo_t algo,
                     void* workspace, InBandCheck* check) {
  const Topology& topo = comm.topology();
  const size_t world = topo.size, chunk = layout.chunk_bytes();
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  const FlexPath path = choose_flex_path(comm, layout, algo);

  if (path == FlexPath::kContiguous) {
    if (algo == A2A_ALGO_2DH)
      all_to_all_2dh(comm, send, recv, chunk, workspace, check);
    else
      all_to_all_linear(comm, send, recv, chunk, check);
    return;
  }
  if (path == FlexPath::kDatatypes) {
    exchange(
        comm, check, world_group(topo),
        [&](int i) {
          return Span::strided(in + i * layout.split_inner, layout.split_inner, layout.split_outer,
                               world * layout.split_inner);
        },
        [&](int j) {
          return Span::strided(out + j * layout.concat_inner, layout.concat_inner, layout.concat_outer,
                               world * layout.concat_inner);
        });
    return;
  }
  if (path == FlexPath::kPieces) {
    // Piece k of the stream to peer i, and of the stream from peer j.
    const size_t piece = piece_bytes(layout), pieces = chunk / piece;
    auto send_piece = [&](int i, size_t k) {
      const size_t at = k * piece, block = at / layout.split_inner;
      return Span::contiguous(in + (block * world + i) * layout.split_inner + at % layout.split_inner, piece);
    };
    auto recv_piece = [&](int j, size_t k) {
      const size_t at = k * piece, block = at / layout.concat_inner;
      return Span::contiguous(out + (block * world + j) * layout.concat_inner + at % layout.concat_inner, piece);
    };
    exchange_pieces(comm, check, world_group(topo), pieces, send_piece, recv_piece);
    return;
  }

  // Packed.
  char* ws = static_cast<char*>(workspace);
  const char* send_chunks = in;
  if (layout.split_outer > 1) {
    comm.device().transpose_chunks(ws, in, layout.split_outer, world, layout.split_inner);
    send_chunks = ws;
    ws += chunk * world;
  }
  char* recv_chunks = out;
  if (layout.concat_outer > 1) {
    recv_chunks = ws;
    ws += chunk * world;
  }
  if (algo == A2A_ALGO_2DH)
    all_to_all_2dh(comm, send_chunks, recv_chunks, chunk, ws, check);
  else
    all_to_all_linear(comm, send_chunks, recv_chunks, chunk, check);
  if (layout.concat_outer > 1)
    comm.device().transpose_chunks(out, recv_chunks, world, layout.concat_outer, layout.concat_inner);
}

// ---------------------------------------------------------------------------
// Uneven all-to-all

namespace {

std::vector<size_t> prefix_offsets(const std::vector<int64_t>& counts) {
  std::vector<size_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + static_cast<size_t>(counts[i]);
  return offsets;
}

size_t relay_bytes(const VCounts& counts) {
  return std::accumulate(counts.relay.begin(), counts.relay.end(), size_t{0});
}

}  // namespace

void all_to_all_v_linear(Comm& comm, const void* send, void* recv, const VCounts& counts, InBandCheck* check) {
  const auto send_off = prefix_offsets(counts.send), recv_off = prefix_offsets(counts.recv);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  exchange(
      comm, check, world_group(comm.topology()),
      [&](int i) { return Span::contiguous(in + send_off[i], static_cast<size_t>(counts.send[i])); },
      [&](int j) { return Span::contiguous(out + recv_off[j], static_cast<size_t>(counts.recv[j])); });
}

size_t all_to_all_v_2dh_workspace(const Topology& topo, const VCounts& counts) {
  if (topo.num_nodes == 1 || topo.local_size == 1) return 0;
  const size_t send_total = prefix_offsets(counts.send).back();
  const size_t relay = relay_bytes(counts);
  return std::max(send_total, relay) + relay;
}

// 2DH with uneven chunks, same phases as the uniform one; the transposes
// become lists of copies because chunks differ in size.
//   phase 1  staging [L][N]: send regrouped by destination local rank
//   phase 2  relay   [L][N]: from local peer l'', its data for (m, my l), sizes counts.relay
//   phase 3  staging [N][L]: relay regrouped by destination node
//   phase 4  recv    [N][L]: from (m, my l), the data of ranks (m, l''), in source-rank order
void all_to_all_v_2dh(Comm& comm, const void* send, void* recv, const VCounts& counts, void* workspace,
                      InBandCheck* check) {
  const Topology& topo = comm.topology();
  if (topo.num_nodes == 1 || topo.local_size == 1) {
    all_to_all_v_linear(comm, send, recv, counts, check);
    return;
  }
  const int nodes = topo.num_nodes, locals = topo.local_size;
  const auto send_off = prefix_offsets(counts.send), recv_off = prefix_offsets(counts.recv);
  const size_t send_total = send_off.back(), relay_total = relay_bytes(counts);
  char* staging = static_cast<char*>(workspace);
  char* relay = staging + std::max(send_total, relay_total);

  std::vector<CopyRange> copies;
  std::vector<size_t> to_local(locals + 1, 0);  // phase-1 row offsets
  for (int l = 0; l < locals; ++l) {
    to_local[l + 1] = to_local[l];
    for (int m = 0; m < nodes; ++m) {
      const int dest = topo.global_rank(m, l);
      copies.push_back(CopyRange{send_off[dest], to_local[l + 1], static_cast<size_t>(counts.send[dest])});
      to_local[l + 1] += counts.send[dest];
    }
  }
  comm.device().copy_ranges(staging, send, copies.data(), copies.size());

  // relay chunk (l'', m) sits at relay_off[l'' * N + m]
  const auto relay_off = prefix_offsets(counts.relay);
  exchange(
      comm, check, node_group(topo), [&](int l) { return Span::contiguous(staging + to_local[l], to_local[l + 1] - to_local[l]); },
      [&](int l) {
        return Span::contiguous(relay + relay_off[l * nodes], relay_off[(l + 1) * nodes] - relay_off[l * nodes]);
      });

  copies.clear();
  std::vector<size_t> to_node(nodes + 1, 0);
  for (int m = 0; m < nodes; ++m) {
    to_node[m + 1] = to_node[m];
    for (int l = 0; l < locals; ++l) {
      const size_t bytes = static_cast<size_t>(counts.relay[l * nodes + m]);
      copies.push_back(CopyRange{relay_off[l * nodes + m], to_node[m + 1], bytes});
      to_node[m + 1] += bytes;
    }
  }
  comm.device().copy_ranges(staging, relay, copies.data(), copies.size());

  char* out = static_cast<char*>(recv);
  exchange(
      comm, check, rail_group(topo), [&](int m) { return Span::contiguous(staging + to_node[m], to_node[m + 1] - to_node[m]); },
      [&](int m) {
        const int first = topo.global_rank(m, 0), end = first + locals;
        return Span::contiguous(out + recv_off[first], recv_off[end] - recv_off[first]);
      });
}

// ---------------------------------------------------------------------------
// All-gather as one exchange over the world

void all_gather_exchange(Comm& comm, const void* send, void* recv, size_t block_bytes, InBandCheck* check) {
  char* out = static_cast<char*>(recv);
  exchange(
      comm, check, world_group(comm.topology()), [&](int) { return Span::contiguous(send, block_bytes); },
      [&](int j) { return Span::contiguous(out + j * block_bytes, block_bytes); });
}

void all_gather_v_exchange(Comm& comm, const void* send, void* recv, const std::vector<size_t>& bytes,
                           InBandCheck* check) {
  const std::vector<size_t> offset = packed_offsets(bytes);
  char* out = static_cast<char*>(recv);
  const size_t mine = bytes[comm.rank()];
  exchange(
      comm, check, world_group(comm.topology()), [&](int) { return Span::contiguous(send, mine); },
      [&](int j) { return Span::contiguous(out + offset[j], bytes[j]); });
}

}  // namespace a2a
