// The device interface: where bytes live and how local layout copies run.
// CPU: plain memory and host copies. CUDA (later): a caller's stream.
#pragma once

#include <cstddef>

namespace a2a {

struct CopyRange {
  size_t src_offset;
  size_t dst_offset;
  size_t bytes;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Views src as a rows x cols grid of chunk_bytes chunks (row-major) and
  // writes its transpose, a cols x rows grid, to dst: chunk (r, c) of src lands
  // at chunk (c, r) of dst. This is Tutel's strideMemcpy and the flexible
  // all-to-all's layout change. dst and src must not overlap.
  virtual void transpose_chunks(void* dst, const void* src, size_t rows, size_t cols,
                                size_t chunk_bytes) = 0;
  // Many independent copies between two buffers (2DH with uneven counts).
  virtual void copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count) = 0;
};

}  // namespace a2a
