// layout_cuda.cu's host entry points and kernels (transpose_chunks,
// copy_ranges), run by the CUDA emulation of include/ (see run.py), bitwise
// against their CPU twins (cpu/cpu_device.cpp) on the same inputs: every
// vector width (16, 8, 4, 2, 1 bytes, from misaligned pointers and sizes),
// chunks shorter than a group and longer than a block's piece, the byte head
// and tail of a range, more ranges than one launch takes, empty inputs, and
// grids capped at 5 to 15 blocks so that every grid-stride loop turns. Every
// output buffer has guard bytes on both sides, and the inputs must stay as
// they were. `layout_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "cpu/cpu_device.hpp"
#include "cuda/layout_cuda.hpp"

using namespace check;

namespace {

// The CUDA side's width rule (layout_cuda.cu), to tell which paths ran.
unsigned widest(uint64_t bits) {
  const uint64_t capped = bits | 16;
  return static_cast<unsigned>(capped & (~capped + 1));
}
unsigned log2_of(unsigned w) { return w == 16 ? 4 : w == 8 ? 3 : w == 4 ? 2 : w == 2 ? 1 : 0; }

// Tallies of what the cases covered, printed at the end.
long long transpose_width[5], range_width[5], multi_piece, heads, tails, batched, grid_strided, errors;

constexpr uint64_t kBlockPieceVectors = 256 * 4;  // kThreads * kUnroll of layout_cuda.cu
constexpr uint64_t kBlocksPerSm = 5;
constexpr size_t kRangesPerLaunch = 1023;  // layout_cuda.cu's with CUDA >= 12.1 (the emulation's CUDART_VERSION)

void random_bytes(unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(rng());
}

int status_of(int status) {
  if (status != 0) throw std::runtime_error("cuda status " + std::to_string(status));
  return status;
}

void transpose_case() {
  // The width the launch must take, w: chunk, src and dst are aligned to w
  // or more, one of them (at random) to exactly w; chunks of more than 1024
  // vectors take several pieces.
  const size_t w = static_cast<size_t>(pick({16, 8, 4, 2, 1}));
  size_t align[3];
  for (size_t& a : align) a = std::min<size_t>(16, w << below(5));
  align[below(3)] = w;
  size_t rows = static_cast<size_t>(pick({0, 1, 2, 3, 7, 33, 64}));
  size_t cols = static_cast<size_t>(pick({0, 1, 2, 3, 5, 16, 41}));
  const size_t chunk =
      rng() % 16 == 0 ? 0 : align[0] * static_cast<size_t>(pick({1, 3, 5, 7, 9, 63, 251, 1025, 4099}));
  const size_t src_shift = align[1] * static_cast<size_t>(pick({1, 3, 5, 7})) % 16,
               dst_shift = align[2] * static_cast<size_t>(pick({1, 3, 5, 7})) % 16;
  while (rows * cols * chunk > (size_t{1} << 19)) (rows >= cols ? rows : cols) /= 2;
  const size_t total = rows * cols * chunk;
  emu::device = static_cast<int>(below(3));  // 1, 2 or 3 SMs: grids of 5 to 15 blocks
  Guarded src(total, src_shift), gpu(total, dst_shift), cpu(total, dst_shift);
  random_bytes(src.data(), total);
  const std::vector<unsigned char> before(src.data(), src.data() + total);
  char what[160];
  std::snprintf(what, sizeof what, "transpose rows=%zu cols=%zu chunk=%zu src+%zu dst+%zu sms=%d", rows, cols, chunk,
                src_shift, dst_shift, emu::device_sms[emu::device]);
  ++cases;
  const std::string error = two_schedules(what, {{gpu.data(), total}}, [&] {
    status_of(a2a::cuda_transpose_chunks(gpu.data(), src.data(), rows, cols, chunk, nullptr));
  });
  a2a::CpuDevice(1).transpose_chunks(cpu.data(), src.data(), rows, cols, chunk);
  expect(error.empty(), "%s: %s", what, error.c_str());
  expect(std::equal(gpu.data(), gpu.data() + total, cpu.data()), "%s: differs from the CPU", what);
  expect(gpu.guards_intact(), "%s: wrote outside dst", what);
  expect(std::equal(before.begin(), before.end(), src.data()), "%s: changed src", what);
  if (total == 0) return;
  const unsigned width =
      widest(reinterpret_cast<uintptr_t>(gpu.data()) | reinterpret_cast<uintptr_t>(src.data()) | chunk);
  expect(width == w, "%s: width %u, not %zu", what, width, w);  // the case is what it meant to be
  ++transpose_width[log2_of(width)];
  multi_piece += chunk / w > kBlockPieceVectors;
  grid_strided += total / w > kBlocksPerSm * emu::device_sms[emu::device] * kBlockPieceVectors;
}

void copy_ranges_case() {
  const size_t count = static_cast<size_t>(pick({0, 1, 2, 5, 40, 120, 121, 361, 1023, 1024, 2100}));
  const bool aligned = rng() % 3 == 0;  // the usual case: every range 16-byte aligned on both sides
  const bool large = count <= 5;
  std::vector<a2a::CopyRange> ranges(count);
  const size_t src_bytes = large ? 150000 : 30000;
  size_t cursor = 0;
  for (a2a::CopyRange& r : ranges) {
    r.bytes = static_cast<size_t>(large ? pick({0, 1, 17, 1000, 16384 + 3, 40000 + 5, 100000})
                                        : pick({0, 1, 2, 3, 7, 15, 16, 17, 33, 100, 255, 1000, 4096 + 5}));
    if (rng() % 8 == 0) r.bytes = 0;
    r.src_offset = static_cast<size_t>(below(static_cast<int64_t>(src_bytes - r.bytes)));
    cursor += static_cast<size_t>(below(40));  // destinations do not overlap; gaps must stay untouched
    r.dst_offset = cursor;
    if (aligned) {
      r.src_offset &= ~size_t{15};
      r.dst_offset = (r.dst_offset + 15) & ~size_t{15};
    }
    cursor = r.dst_offset + r.bytes;
  }
  const size_t dst_bytes = cursor + static_cast<size_t>(below(20));
  const size_t src_shift = aligned ? 0 : static_cast<size_t>(below(16)),
               dst_shift = aligned ? 0 : static_cast<size_t>(below(16));
  emu::device = static_cast<int>(below(3));
  Guarded src(src_bytes, src_shift), gpu(dst_bytes, dst_shift), cpu(dst_bytes, dst_shift);
  random_bytes(src.data(), src_bytes);
  random_bytes(gpu.data(), dst_bytes);
  std::copy(gpu.data(), gpu.data() + dst_bytes, cpu.data());
  const std::vector<unsigned char> before(src.data(), src.data() + src_bytes);
  char what[160];
  std::snprintf(what, sizeof what, "copy_ranges count=%zu aligned=%d dst=%zu src+%zu dst+%zu sms=%d", count, aligned,
                dst_bytes, src_shift, dst_shift, emu::device_sms[emu::device]);
  ++cases;
  const std::string error = two_schedules(what, {{gpu.data(), dst_bytes}}, [&] {
    status_of(a2a::cuda_copy_ranges(gpu.data(), src.data(), ranges.data(), count, nullptr));
  });
  a2a::CpuDevice(1).copy_ranges(cpu.data(), src.data(), ranges.data(), count);
  expect(error.empty(), "%s: %s", what, error.c_str());
  expect(std::equal(gpu.data(), gpu.data() + dst_bytes, cpu.data()), "%s: differs from the CPU", what);
  expect(gpu.guards_intact(), "%s: wrote outside dst", what);
  expect(std::equal(before.begin(), before.end(), src.data()), "%s: changed src", what);
  size_t by_width[5] = {};
  for (const a2a::CopyRange& r : ranges) {
    if (r.bytes == 0) continue;
    const uintptr_t from = reinterpret_cast<uintptr_t>(src.data()) + r.src_offset;
    const unsigned w = widest(reinterpret_cast<uintptr_t>(gpu.data()) + r.dst_offset - from);
    ++range_width[log2_of(w)];
    ++by_width[log2_of(w)];
    const size_t head = std::min<size_t>(r.bytes, (w - from % w) % w);
    heads += head != 0;
    tails += (r.bytes - head) % w != 0;
    grid_strided += (r.bytes - head) / w > kBlocksPerSm * emu::device_sms[emu::device] * kBlockPieceVectors;
  }
  for (size_t n : by_width) batched += n > kRangesPerLaunch;
}

// A transpose whose size wraps around 2^64 describes no buffer: an error, no launch.
void overflow_case() {
  ++cases;
  const long long launched = emu::launches;
  const int status = a2a::cuda_transpose_chunks(nullptr, nullptr, size_t{1} << 33, size_t{1} << 32, 1, nullptr);
  expect(status != 0 && emu::launches == launched, "transpose of 2^65 bytes: status %d, no launch expected", status);
  ++errors;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 20);
  overflow_case();
  for (int64_t i = 0; i < n; ++i) {
    transpose_case();
    copy_ranges_case();
  }
  std::printf("transpose widths 16/8/4/2/1: %lld %lld %lld %lld %lld; chunks of several pieces: %lld\n",
              transpose_width[4], transpose_width[3], transpose_width[2], transpose_width[1], transpose_width[0],
              multi_piece);
  std::printf("range widths 16/8/4/2/1: %lld %lld %lld %lld %lld; byte heads %lld, tails %lld; "
              "widths of > %zu ranges (several launches): %lld; grid-stride loops: %lld\n",
              range_width[4], range_width[3], range_width[2], range_width[1], range_width[0], heads, tails, kRangesPerLaunch,
              batched,
              grid_strided);
  return summary("layout_cuda");
}
