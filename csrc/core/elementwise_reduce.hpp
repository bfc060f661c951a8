// The element-wise reduction of the dense collectives where a2a reduces
// itself: the float16 / bfloat16 operations MPI lacks (user MPI_Ops), and the
// reductions that carry the cross-rank check in their own messages
// (core/reduce_exchanges.cpp). float16 and bfloat16 are reduced in float32 and
// rounded back at every step, as NCCL does; a NaN operand gives NaN for every
// operation, whatever the order.
#pragma once

#include <cstddef>

#include "a2a/a2a.h"
#include "core/transport.hpp"

namespace a2a {

// inout[i] = op(inout[i], in[i]) for i < count elements of dtype.
void reduce_into(void* inout, const void* in, size_t count, a2a_dtype_t dtype, ReduceOp op);

}  // namespace a2a
