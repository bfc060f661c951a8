#include "cpu/cpu_device.hpp"

#include <cstring>

namespace a2a {

void CpuDevice::copy(void* dst, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
}

void CpuDevice::transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) {
  if (chunk_bytes == 0) return;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // Walk the destination in order: sequential writes, `rows` read streams.
  for (size_t c = 0; c < cols; ++c)
    for (size_t r = 0; r < rows; ++r)
      std::memcpy(out + (c * rows + r) * chunk_bytes, in + (r * cols + c) * chunk_bytes, chunk_bytes);
}

void CpuDevice::copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  for (size_t i = 0; i < count; ++i)
    if (ranges[i].bytes != 0) std::memcpy(out + ranges[i].dst_offset, in + ranges[i].src_offset, ranges[i].bytes);
}

}  // namespace a2a
