#include "cpu/cpu_device.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/thread_pool.hpp"

namespace a2a {

namespace {

// Copies below this many bytes stay on the calling thread: waking the pool
// costs more than the copy (docs/benchmarks.md, "CPU layout copies").
constexpr int64_t kParallelCopyBytes = 1 << 20;
// Each thread's share is at least this many bytes.
constexpr int64_t kCopyGrainBytes = 256 << 10;

// body(begin, end) over [0, total) bytes: on the pool's threads where the
// bytes justify it, else on this thread.
template <typename Body>
void over_bytes(int num_threads, size_t total, const Body& body) {
  if (static_cast<int64_t>(total) < kParallelCopyBytes || num_threads == 1) {
    body(size_t{0}, total);
    return;
  }
  cpu::parallel_for(static_cast<int64_t>(total), kCopyGrainBytes, num_threads,
                    [&](int64_t begin, int64_t end) { body(static_cast<size_t>(begin), static_cast<size_t>(end)); });
}

}  // namespace

void CpuDevice::copy_impl(void* dst, const void* src, size_t bytes) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  over_bytes(num_threads_, bytes, [&](size_t begin, size_t end) {
    if (end > begin) std::memcpy(out + begin, in + begin, end - begin);
  });
}

// Destination byte d lies in chunk q = d / chunk_bytes, which is chunk
// (c, r) = (q / rows, q % rows) of the cols x rows output and comes from chunk
// (r, c) of the input. Each thread writes one stretch of the destination in
// order: sequential writes, `rows` read streams.
void CpuDevice::transpose_chunks_impl(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) {
  if (chunk_bytes == 0) return;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  over_bytes(num_threads_, rows * cols * chunk_bytes, [&](size_t begin, size_t end) {
    while (begin < end) {
      const size_t q = begin / chunk_bytes, offset = begin % chunk_bytes;
      const size_t c = q / rows, r = q % rows;
      const size_t bytes = std::min(chunk_bytes - offset, end - begin);
      std::memcpy(out + begin, in + (r * cols + c) * chunk_bytes + offset, bytes);
      begin += bytes;
    }
  });
}

// The ranges laid end to end make one stream of bytes; each thread copies one
// stretch of it, starting in the range that holds its first byte.
void CpuDevice::copy_ranges_impl(void* dst, const void* src, const CopyRange* ranges, size_t count) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  std::vector<size_t> starts(count + 1, 0);
  for (size_t i = 0; i < count; ++i) starts[i + 1] = starts[i] + ranges[i].bytes;
  over_bytes(num_threads_, starts[count], [&](size_t begin, size_t end) {
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    for (; begin < end && i < count; ++i) {
      const size_t offset = begin - starts[i];
      const size_t bytes = std::min(ranges[i].bytes - offset, end - begin);
      if (bytes != 0)
        std::memcpy(out + ranges[i].dst_offset + offset, in + ranges[i].src_offset + offset, bytes);
      begin += bytes;
    }
  });
}

}  // namespace a2a
