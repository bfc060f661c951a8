#include "core/reduce_exchanges.hpp"

#include <cstring>

#include "core/algorithms.hpp"
#include "core/dtype.hpp"
#include "core/elementwise_reduce.hpp"
#include "core/error.hpp"

namespace a2a {

namespace {

// The blocks this rank receives land side by side in host memory.
void require_host(Comm& comm, const char* what) {
  if (comm.device_type() != A2A_DEVICE_CPU)
    fail(A2A_ERROR_INTERNAL, what, " reduces on the host; this communicator's memory is on a device");
}

// Reduces block r of every rank (counts as given) into this rank's `out`.
void scatter_and_reduce(Comm& comm, const char* send, void* out, const std::vector<size_t>& counts,
                        a2a_dtype_t dtype, ReduceOp op, InBandCheck* check) {
  const size_t item = dtype_size(dtype);
  const std::vector<size_t> offsets = packed_offsets(counts);
  const size_t mine = counts[comm.rank()] * item;
  char* received = comm.host_scratch(mine * comm.size());
  exchange(
      comm, check, world_group(comm.topology()),
      [&](int i) { return Span::contiguous(send + offsets[i] * item, counts[i] * item); },
      [&](int j) { return Span::contiguous(received + j * mine, mine); });
  if (mine == 0) return;
  std::memcpy(out, received, mine);
  for (int j = 1; j < comm.size(); ++j) reduce_into(out, received + j * mine, counts[comm.rank()], dtype, op);
}

}  // namespace

void reduce_scatter_exchange(Comm& comm, const void* send, void* recv, const std::vector<size_t>& counts,
                             a2a_dtype_t dtype, ReduceOp op, InBandCheck* check) {
  require_host(comm, "reduce_scatter");
  scatter_and_reduce(comm, static_cast<const char*>(send), recv, counts, dtype, op, check);
}

void all_reduce_exchanges(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op,
                          InBandCheck* check) {
  require_host(comm, "all_reduce");
  const int world = comm.size(), me = comm.rank();
  const size_t item = dtype_size(dtype);
  std::vector<size_t> pieces(world, count / world);
  for (size_t r = 0; r < count % world; ++r) ++pieces[r];
  const std::vector<size_t> offsets = packed_offsets(pieces);
  char* out = static_cast<char*>(recv);
  char* reduced = out + offsets[me] * item;
  // In place, the first exchange has sent every piece before this rank's is overwritten.
  scatter_and_reduce(comm, static_cast<const char*>(send), reduced, pieces, dtype, op, check);
  const Span nothing = Span::contiguous(nullptr, 0);  // this rank's piece is already in place
  exchange(
      comm, check, world_group(comm.topology()),
      [&](int i) { return i == me ? nothing : Span::contiguous(reduced, pieces[me] * item); },
      [&](int j) { return j == me ? nothing : Span::contiguous(out + offsets[j] * item, pieces[j] * item); });
}

}  // namespace a2a
