// The CUDA layout kernels behind the CUDA Device's transpose_chunks and
// copy_ranges (core/device.hpp). Plain C++: no CUDA header, so the stream is a
// void* (a cudaStream_t; nullptr is the legacy default stream) and the result
// a cudaError_t as int, 0 on success, which the caller turns into its own error.
// Both enqueue on the stream of the current device and return without waiting;
// neither allocates nor synchronizes, so both may be captured into a CUDA graph.
#pragma once

#include <cstddef>

#include "core/device.hpp"

namespace a2a {

// Views src as a rows x cols grid of chunk_bytes chunks (row-major) and writes
// its transpose to dst: chunk (r, c) of src lands at chunk (c, r) of dst.
// dst and src are device pointers that do not overlap. No work, no launch.
int cuda_transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes, void* stream);

// count independent copies dst + r.dst_offset <- src + r.src_offset of r.bytes
// each. The ranges are in host memory and are read before this returns; their
// destinations must not overlap one another or the sources.
int cuda_copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count, void* stream);

}  // namespace a2a
