#include "core/algorithms.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

namespace a2a {

PeerGroup world_group(const Topology& topo) { return PeerGroup{0, 1, topo.size, topo.rank}; }
PeerGroup node_group(const Topology& topo) {
  return PeerGroup{topo.node * topo.local_size, 1, topo.local_size, topo.local_rank};
}
PeerGroup rail_group(const Topology& topo) {
  return PeerGroup{topo.local_rank, topo.local_size, topo.num_nodes, topo.node};
}

void exchange(Comm& comm, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span) {
  exchange(comm.transport(), group, send_span, recv_span);
}

void exchange(Transport& transport, const PeerGroup& group, const std::function<Span(int)>& send_span,
              const std::function<Span(int)>& recv_span) {
  transport.group_start();
  try {
    // Receives first, so that arriving messages find a posted buffer.
    for (int step = 0; step < group.count; ++step) {
      const int from = (group.me - step + group.count) % group.count;
      transport.recv(recv_span(from), group.member(from));
    }
    for (int step = 0; step < group.count; ++step) {
      const int to = (group.me + step) % group.count;
      transport.send(send_span(to), group.member(to));
    }
  } catch (...) {
    transport.cancel_group();
    throw;
  }
  transport.group_end();
}

// ---------------------------------------------------------------------------
// Uniform all-to-all

void all_to_all_linear(Comm& comm, const void* send, void* recv, size_t chunk_bytes) {
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  exchange(
      comm, world_group(comm.topology()), [&](int i) { return Span::contiguous(in + i * chunk_bytes, chunk_bytes); },
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
void all_to_all_2dh(Comm& comm, const void* send, void* recv, size_t chunk_bytes, void* workspace) {
  const Topology& topo = comm.topology();
  if (topo.num_nodes == 1 || topo.local_size == 1) {
    all_to_all_linear(comm, send, recv, chunk_bytes);
    return;
  }
  const size_t nodes = topo.num_nodes, locals = topo.local_size;
  char* ws = static_cast<char*>(workspace);
  char* out = static_cast<char*>(recv);
  const size_t row_to_local = nodes * chunk_bytes;  // one row of the [L][N] grid
  const size_t row_to_node = locals * chunk_bytes;  // one row of the [N][L] grid

  comm.device().transpose_chunks(ws, send, nodes, locals, chunk_bytes);
  exchange(
      comm, node_group(topo), [&](int l) { return Span::contiguous(ws + l * row_to_local, row_to_local); },
      [&](int l) { return Span::contiguous(out + l * row_to_local, row_to_local); });
  comm.device().transpose_chunks(ws, out, locals, nodes, chunk_bytes);
  exchange(
      comm, rail_group(topo), [&](int m) { return Span::contiguous(ws + m * row_to_node, row_to_node); },
      [&](int m) { return Span::contiguous(out + m * row_to_node, row_to_node); });
}

// ---------------------------------------------------------------------------
// Flexible all-to-all
//
// Send side: the input is [split_outer][world][split_inner]; rank i gets the
// column [:, i, :], which is strided unless split_outer == 1.
// Receive side: the output is [concat_outer][world][concat_inner]; rank j's
// chunk fills [:, j, :]. With strided spans the transport moves these layouts
// directly (no extra copy); otherwise they are packed through the workspace.

namespace {

bool pack_send(const FlexLayout& layout) { return layout.split_outer > 1; }
bool unpack_recv(const FlexLayout& layout) { return layout.concat_outer > 1; }

// Strided spans straight to the transport: the linear algorithm on a
// transport that takes them, while MPI's int block count is enough.
bool direct_spans(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo) {
  constexpr size_t kMaxBlocks = static_cast<size_t>(std::numeric_limits<int>::max());
  return algo == A2A_ALGO_LINEAR && comm.strided_spans() && layout.split_outer <= kMaxBlocks &&
         layout.concat_outer <= kMaxBlocks;
}

}  // namespace

size_t all_to_all_flex_workspace(const Comm& comm, const FlexLayout& layout, a2a_algo_t algo) {
  const Topology& topo = comm.topology();
  const size_t total = layout.chunk_bytes() * topo.size;
  if (direct_spans(comm, layout, algo)) return 0;
  size_t bytes = (pack_send(layout) ? total : 0) + (unpack_recv(layout) ? total : 0);
  if (algo == A2A_ALGO_2DH) bytes += all_to_all_2dh_workspace(topo, layout.chunk_bytes());
  return bytes;
}

void all_to_all_flex(Comm& comm, const void* send, void* recv, const FlexLayout& layout, a2a_algo_t algo,
                     void* workspace) {
  const Topology& topo = comm.topology();
  const size_t world = topo.size, chunk = layout.chunk_bytes();
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);

  if (direct_spans(comm, layout, algo)) {
    exchange(
        comm, world_group(topo),
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

  char* ws = static_cast<char*>(workspace);
  const char* send_chunks = in;
  if (pack_send(layout)) {
    comm.device().transpose_chunks(ws, in, layout.split_outer, world, layout.split_inner);
    send_chunks = ws;
    ws += chunk * world;
  }
  char* recv_chunks = out;
  if (unpack_recv(layout)) {
    recv_chunks = ws;
    ws += chunk * world;
  }
  if (algo == A2A_ALGO_2DH)
    all_to_all_2dh(comm, send_chunks, recv_chunks, chunk, ws);
  else
    all_to_all_linear(comm, send_chunks, recv_chunks, chunk);
  if (unpack_recv(layout)) comm.device().transpose_chunks(out, recv_chunks, world, layout.concat_outer, layout.concat_inner);
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

void all_to_all_v_linear(Comm& comm, const void* send, void* recv, const VCounts& counts) {
  const auto send_off = prefix_offsets(counts.send), recv_off = prefix_offsets(counts.recv);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  exchange(
      comm, world_group(comm.topology()),
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
void all_to_all_v_2dh(Comm& comm, const void* send, void* recv, const VCounts& counts, void* workspace) {
  const Topology& topo = comm.topology();
  if (topo.num_nodes == 1 || topo.local_size == 1) {
    all_to_all_v_linear(comm, send, recv, counts);
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
      comm, node_group(topo), [&](int l) { return Span::contiguous(staging + to_local[l], to_local[l + 1] - to_local[l]); },
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
      comm, rail_group(topo), [&](int m) { return Span::contiguous(staging + to_node[m], to_node[m + 1] - to_node[m]); },
      [&](int m) {
        const int first = topo.global_rank(m, 0), end = first + locals;
        return Span::contiguous(out + recv_off[first], recv_off[end] - recv_off[first]);
      });
}

}  // namespace a2a
