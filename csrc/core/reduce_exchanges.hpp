// The dense reductions as labelled exchanges over the world, so that on a
// communicator that checks in band (MPI on the CPU) they carry the
// cross-rank check in their own messages instead of a round of their own
// (docs/algorithms.md, "The argument check"). Written against Transport like
// the all-to-alls; the arithmetic is core/elementwise_reduce.hpp's, on the
// host (no device reduces here).
//
//   reduce_scatter   one exchange: block r of every rank goes to rank r,
//                    which reduces the W blocks it received, in rank order
//   all_reduce       the buffer cut into W pieces (the first count % W one
//                    element longer); a reduce-scatter exchange of the
//                    pieces, then an all-gather exchange of the reduced
//                    pieces: each rank sends and receives 2 (W - 1) / W of
//                    the buffer, as a ring or Rabenseifner's algorithm does,
//                    in two rounds
//
// Every element is reduced by one rank in rank order, so every rank holds the
// same bits.
#pragma once

#include <cstddef>
#include <vector>

#include "a2a/a2a.h"
#include "core/comm.hpp"

namespace a2a {

// counts[r]: the elements of rank r's block; send holds every block, packed in
// rank order; recv receives this rank's block, reduced.
void reduce_scatter_exchange(Comm& comm, const void* send, void* recv, const std::vector<size_t>& counts,
                             a2a_dtype_t dtype, ReduceOp op, InBandCheck* check);
// count elements; send == recv reduces in place.
void all_reduce_exchanges(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op,
                          InBandCheck* check);

}  // namespace a2a
