// CUDA layout kernels (cuda/layout_cuda.hpp): transpose_chunks and
// copy_ranges as copy kernels on the caller's stream, with no allocation and
// no synchronization.
//
// Both move "vectors" of W bytes, W in {16, 8, 4, 2, 1}, as wide as the
// addresses allow (16: one uint4, LDG.E.128 / STG.E.128), and every thread
// issues up to kUnroll independent loads before its stores, so that enough
// bytes are in flight to keep HBM busy. A grid is at most one resident wave
// (kBlocksPerSm blocks of kThreads per SM, which __launch_bounds__ makes fit)
// and grid-strides: every block gets the same share and none waits for a
// second wave.
//
// transpose_chunks. One W for the launch: the widest dividing dst, src and
// chunk_bytes, so that every chunk starts W-aligned on both sides. The work
// items are pieces of chunks in destination order (adjacent groups write
// adjacent bytes). A group of `lanes` threads (a power of two, 1 .. kThreads,
// sized to the chunk) copies one piece per step: small chunks share a block,
// and a chunk longer than kThreads * kUnroll vectors is cut into pieces that
// several blocks copy. A group finds its first item with two divisions and
// then steps by the grid stride, split on the host into (column, row, piece)
// steps, with adds and compares only.
//
// copy_ranges. Each range copies at its own W, the widest at which its source
// and destination are equally misaligned: a byte head up to the W boundary,
// W-byte vectors, a byte tail. Ranges of one W go in batches of up to
// kRangesPerLaunch, passed by value in the kernel's parameter (the table is
// never copied to the device), one launch per batch: with the usual aligned
// buffers, all ranges have W = 16 and a batch is simply the next 1023 ranges
// (127 with a CUDA older than 12.1).
// A range's vectors are cut into tiles of kThreads * kUnroll, and the blocks
// grid-stride over the tiles of all ranges of the batch, so a large range is
// spread over many blocks and the grid is sized from the tiles, not from the
// number of ranges (tiny ranges launch no idle blocks).
//
// The per-thread bodies are __host__ __device__ and take the block and thread
// index as arguments; the kernels are thin wrappers around them, so a host test
// can run the very same index arithmetic thread by thread.
#include "cuda/layout_cuda.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

namespace a2a {

namespace {

// ---------------------------------------------------------------------------
// Launch shapes

constexpr uint32_t kThreads = 256;
// Independent loads per thread before its stores: 16 KiB in flight per block
// step at 16-byte width.
constexpr uint32_t kUnroll = 4;
// Resident blocks of kThreads per SM that the kernels are compiled to fit: 5
// leaves 48 registers a thread, which the uint4 paths need without spilling
// (8 would cap them at 32 and spill); 5 x 256 threads x 4 x 16 bytes is still
// 80 KiB in flight per SM, well above what HBM3 needs.
constexpr uint32_t kBlocksPerSm = 5;
// A group is at least this wide in bytes (or the whole chunk), so a warp's
// access covers whole 128-byte lines instead of scattered 16-byte pieces.
constexpr uint32_t kMinSegmentBytes = 128;
constexpr uint64_t kMaxWidth = 16;
// copy_ranges copies a range's head bytes with threads [0, 16) and its tail bytes with [16, 32).
static_assert(kThreads >= 2 * kMaxWidth, "head and tail threads");
// copy_ranges: vectors per tile, one block step.
constexpr uint64_t kTileVectors = uint64_t{kThreads} * kUnroll;
// Kernel parameter bytes: 32764 since CUDA 12.1 (Volta and newer, which is
// every architecture CUDA 12 builds with a parameter this size; nvcc refuses
// it for older ones, loudly; the driver must be R530 or newer, else the launch
// fails with an error), 4096 before. A launch costs the host about the same
// whatever its ranges, so the fewer launches the better: 1023 ranges per
// launch where 120 fit before, so 2DH's and the bench's thousands of chunks
// are a few launches, not one per 120 ranges.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr size_t kMaxParameterBytes = 32764;
#else
constexpr size_t kMaxParameterBytes = 4096;
#endif
// Devices whose SM count is cached; any others are asked on every launch.
constexpr int kMaxCachedDevices = 64;

// The copy loops are __host__ __device__: only the device pass knows the
// pragma (and needs it, so that the value arrays stay in registers).
#ifdef __CUDA_ARCH__
#define A2A_UNROLL _Pragma("unroll")
#else
#define A2A_UNROLL
#endif

__host__ __device__ __forceinline__ uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
// No a + b - 1: that wraps for sizes near 2^64.
__host__ __device__ __forceinline__ uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// The widest power of two <= kMaxWidth dividing `bits` (its lowest set bit).
__host__ __device__ __forceinline__ unsigned widest_width(uint64_t bits) {
  const uint64_t capped = bits | kMaxWidth;
  return static_cast<unsigned>(capped & (~capped + 1));
}

unsigned log2_of(unsigned power_of_two) {
  unsigned log = 0;
  while ((1u << log) < power_of_two) ++log;
  return log;
}

// ---------------------------------------------------------------------------
// Vectors

template <unsigned kWidth>
struct VectorOf;
template <>
struct VectorOf<16> {
  using type = uint4;
};
template <>
struct VectorOf<8> {
  using type = uint2;
};
template <>
struct VectorOf<4> {
  using type = unsigned int;
};
template <>
struct VectorOf<2> {
  using type = unsigned short;
};
template <>
struct VectorOf<1> {
  using type = unsigned char;
};

// Calls f(V{}) with the vector type of `width` (a power of two <= 16).
template <typename F>
int with_vector(unsigned width, F&& f) {
  switch (width) {
    case 16: return f(VectorOf<16>::type{});
    case 8: return f(VectorOf<8>::type{});
    case 4: return f(VectorOf<4>::type{});
    case 2: return f(VectorOf<2>::type{});
    default: return f(VectorOf<1>::type{});
  }
}

template <typename V>
__host__ __device__ __forceinline__ V load_vector(const V* src) {
#ifdef __CUDA_ARCH__
  return *src;
#else
  V value;
  std::memcpy(&value, src, sizeof value);
  return value;
#endif
}

template <typename V>
__host__ __device__ __forceinline__ void store_vector(V* dst, const V& value) {
#ifdef __CUDA_ARCH__
  // A plain store: V is one register-sized type, so this is one instruction of
  // its width (STG.E.128 for uint4). __stwb would make it STG.E.128.STRONG.SM
  // and, being opaque, would keep the loads off the non-coherent path.
  *dst = value;
#else
  std::memcpy(dst, &value, sizeof value);
#endif
}

// ---------------------------------------------------------------------------
// transpose_chunks

struct TransposePlan {
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t chunk_vectors = 0;  // chunk_bytes / width
  uint64_t pieces = 0;         // pieces per chunk
  uint64_t piece_vectors = 0;  // a multiple of lanes, at most lanes * kUnroll; the last piece may be shorter
  // The grid stride in items, (blocks * kThreads / lanes), as whole columns,
  // rows (< rows) and pieces (< pieces) of the item order.
  uint64_t step_col = 0;
  uint64_t step_row = 0;
  uint64_t step_piece = 0;
  uint32_t lanes = 1;
  uint32_t lane_shift = 0;  // log2(lanes)
  uint32_t width = 1;
  uint32_t blocks = 0;
};

// rows, cols and chunk_bytes are nonzero and rows * cols * chunk_bytes fits.
TransposePlan plan_transpose(uintptr_t dst, uintptr_t src, uint64_t rows, uint64_t cols, uint64_t chunk_bytes,
                             uint32_t max_blocks) {
  TransposePlan plan;
  plan.rows = rows;
  plan.cols = cols;
  plan.width = widest_width(dst | src | chunk_bytes);
  plan.chunk_vectors = chunk_bytes / plan.width;
  // Enough lanes for kUnroll vectors each to cover the chunk, up to a block,
  // but at least a 128-byte segment (or the whole chunk).
  while (plan.lanes < kThreads && uint64_t{plan.lanes} * kUnroll < plan.chunk_vectors) plan.lanes *= 2;
  while (plan.lanes < kMinSegmentBytes / plan.width && plan.lanes < plan.chunk_vectors) plan.lanes *= 2;
  plan.lane_shift = log2_of(plan.lanes);
  // Pieces of equal length (whole lanes), not full ones and a stub.
  plan.pieces = ceil_div(plan.chunk_vectors, uint64_t{plan.lanes} * kUnroll);
  plan.piece_vectors = ceil_div(ceil_div(plan.chunk_vectors, plan.pieces), plan.lanes) * plan.lanes;
  const uint64_t items = rows * cols * plan.pieces;  // <= rows * cols * chunk_bytes
  const uint64_t groups_per_block = kThreads / plan.lanes;
  plan.blocks = static_cast<uint32_t>(min_u64(ceil_div(items, groups_per_block), max_blocks));
  const uint64_t stride = uint64_t{plan.blocks} * groups_per_block;
  plan.step_piece = stride % plan.pieces;
  plan.step_row = stride / plan.pieces % rows;
  plan.step_col = stride / plan.pieces / rows;
  return plan;
}

// Item order: item = (col * rows + row) * pieces + piece, destination order.
template <typename V>
__host__ __device__ __forceinline__ void transpose_thread(V* __restrict__ dst, const V* __restrict__ src,
                                                          const TransposePlan& plan, uint32_t block,
                                                          uint32_t thread) {
  const uint32_t lane = thread & (plan.lanes - 1);
  const uint64_t group = (uint64_t{block} * kThreads + thread) >> plan.lane_shift;
  const uint64_t chunk = group / plan.pieces;
  uint64_t piece = group - chunk * plan.pieces;
  uint64_t col = chunk / plan.rows;
  uint64_t row = chunk - col * plan.rows;
  while (col < plan.cols) {
    const uint64_t first = piece * plan.piece_vectors;
    const V* from = src + (row * plan.cols + col) * plan.chunk_vectors + first;
    V* to = dst + (col * plan.rows + row) * plan.chunk_vectors + first;
    const uint32_t count = static_cast<uint32_t>(min_u64(plan.piece_vectors, plan.chunk_vectors - first));
    V values[kUnroll];
    // All loads first, then all stores: kUnroll loads in flight per thread.
    A2A_UNROLL
    for (uint32_t j = 0; j < kUnroll; ++j) {
      const uint32_t i = j * plan.lanes + lane;
      if (i < count) values[j] = load_vector(from + i);
    }
    A2A_UNROLL
    for (uint32_t j = 0; j < kUnroll; ++j) {
      const uint32_t i = j * plan.lanes + lane;
      if (i < count) store_vector(to + i, values[j]);
    }
    // Advance by the grid stride; each carry is at most one (steps are below
    // their moduli), so one compare each.
    piece += plan.step_piece;
    if (piece >= plan.pieces) {
      piece -= plan.pieces;
      ++row;
    }
    row += plan.step_row;
    if (row >= plan.rows) {
      row -= plan.rows;
      ++col;
    }
    col += plan.step_col;
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    transpose_chunks_kernel(V* __restrict__ dst, const V* __restrict__ src, const TransposePlan plan) {
  transpose_thread(dst, src, plan, blockIdx.x, threadIdx.x);
}

// ---------------------------------------------------------------------------
// copy_ranges

struct RangeEntry {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;     // nonzero
  uint64_t tile_end;  // tiles of this and the earlier ranges of the batch
};

// Ranges per launch: as many as the parameter holds beside the two pointers and the tile count.
constexpr uint32_t kRangesPerLaunch =
    static_cast<uint32_t>((kMaxParameterBytes - 2 * sizeof(void*) - sizeof(uint64_t)) / sizeof(RangeEntry));

struct RangeBatch {
  RangeEntry range[kRangesPerLaunch];
  uint64_t tiles;  // range[last].tile_end
};
static_assert(sizeof(RangeBatch) + 2 * sizeof(void*) <= kMaxParameterBytes, "copy_ranges parameter too large");

struct RangeSplit {
  uint64_t head;     // bytes before the first W boundary of the source (< W)
  uint64_t vectors;  // W-byte vectors after the head
  uint64_t tail;     // bytes after the vectors (< W)
};

// Source and destination share every W boundary exactly when they are equally
// misaligned modulo W.
__host__ __device__ __forceinline__ unsigned range_width(uintptr_t dst, uintptr_t src) {
  return widest_width(dst - src);
}

__host__ __device__ __forceinline__ RangeSplit split_range(uintptr_t src, uint64_t bytes, unsigned width) {
  const uint64_t head = min_u64(bytes, (width - src % width) % width);
  const uint64_t vectors = (bytes - head) / width;
  return {head, vectors, bytes - head - vectors * width};
}

// Tile `tile` of one range whose width is sizeof(V); tile 0 also copies the
// head and tail bytes.
template <typename V>
__host__ __device__ __forceinline__ void copy_range_tile(char* __restrict__ dst, const char* __restrict__ src,
                                                         uint64_t bytes, uint64_t tile, uint32_t thread) {
  const RangeSplit split = split_range(reinterpret_cast<uintptr_t>(src), bytes, sizeof(V));
  const uint64_t first = tile * kTileVectors;  // <= split.vectors: the tile exists
  const V* from = reinterpret_cast<const V*>(src + split.head) + first;
  V* to = reinterpret_cast<V*>(dst + split.head) + first;
  const uint32_t count = static_cast<uint32_t>(min_u64(kTileVectors, split.vectors - first));
  V values[kUnroll];
  A2A_UNROLL
  for (uint32_t j = 0; j < kUnroll; ++j) {
    const uint32_t i = j * kThreads + thread;
    if (i < count) values[j] = load_vector(from + i);
  }
  A2A_UNROLL
  for (uint32_t j = 0; j < kUnroll; ++j) {
    const uint32_t i = j * kThreads + thread;
    if (i < count) store_vector(to + i, values[j]);
  }
  if (tile == 0) {  // after the vectors: fewer registers live across the loads
    if (thread < split.head) {
      dst[thread] = src[thread];
    } else if (thread >= kMaxWidth && thread - kMaxWidth < split.tail) {
      const uint64_t i = bytes - split.tail + (thread - kMaxWidth);
      dst[i] = src[i];
    }
  }
}

// Every range of the batch has width sizeof(V).
template <typename V>
__host__ __device__ __forceinline__ void copy_ranges_block(char* __restrict__ dst, const char* __restrict__ src,
                                                           const RangeBatch& batch, uint32_t block,
                                                           uint32_t blocks, uint32_t thread) {
  uint32_t r = 0;
  uint64_t first_tile = 0;
  for (uint64_t tile = block; tile < batch.tiles; tile += blocks) {
    // A block's tiles only grow, so its range index only moves forward.
    while (tile >= batch.range[r].tile_end) first_tile = batch.range[r++].tile_end;
    const RangeEntry& range = batch.range[r];
    copy_range_tile<V>(dst + range.dst_offset, src + range.src_offset, range.bytes, tile - first_tile, thread);
  }
}

// One kernel per width rather than a switch over the widths inside one: with
// all five paths in one body ptxas runs out of registers at kBlocksPerSm and
// interleaves the 16-byte loads with the stores, one load in flight at a time.
// __grid_constant__: the ranges are indexed at run time straight from the
// parameter space, never copied to per-thread local memory.
template <typename V>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    copy_ranges_kernel(char* __restrict__ dst, const char* __restrict__ src, const __grid_constant__ RangeBatch batch) {
  copy_ranges_block<V>(dst, src, batch, blockIdx.x, gridDim.x, threadIdx.x);
}

// Sorts the nonempty ranges by width into batches of up to kRangesPerLaunch
// and calls launch(width, batch) for each full batch and, at the end, for each
// partial one; returns the first nonzero result. Ranges are independent, so
// their order across launches does not matter.
template <typename Launch>
int for_each_range_batch(const void* dst, const void* src, const CopyRange* ranges, size_t count, Launch&& launch) {
  struct Pending {
    RangeBatch batch;
    uint32_t size;
  };
  // By log2(width), made for the widths that occur (32 KiB each: the heap, not the stack).
  std::unique_ptr<Pending> pending[5];
  for (size_t i = 0; i < count; ++i) {
    const CopyRange& range = ranges[i];
    if (range.bytes == 0) continue;
    const uintptr_t from = reinterpret_cast<uintptr_t>(src) + range.src_offset;
    const uintptr_t to = reinterpret_cast<uintptr_t>(dst) + range.dst_offset;
    const unsigned width = range_width(to, from);
    const RangeSplit split = split_range(from, range.bytes, width);
    std::unique_ptr<Pending>& slot = pending[log2_of(width)];
    if (!slot) slot = std::make_unique<Pending>();  // value-initialized: no ranges, no tiles
    Pending& p = *slot;
    p.batch.tiles += split.vectors > kTileVectors ? ceil_div(split.vectors, kTileVectors) : 1;  // tile 0 at least
    p.batch.range[p.size++] = {range.src_offset, range.dst_offset, range.bytes, p.batch.tiles};
    if (p.size == kRangesPerLaunch) {
      if (const int status = launch(width, static_cast<const RangeBatch&>(p.batch))) return status;
      p.size = 0;
      p.batch.tiles = 0;
    }
  }
  for (unsigned log_width = 0; log_width < 5; ++log_width)
    if (pending[log_width] && pending[log_width]->size > 0)
      if (const int status = launch(1u << log_width, static_cast<const RangeBatch&>(pending[log_width]->batch)))
        return status;
  return 0;
}

// ---------------------------------------------------------------------------
// Host side

// One resident wave of blocks on the current device. The SM count is cached
// per device (a device's SM count never changes, and the attribute query would
// otherwise be paid on every launch); zero in the cache means "not asked yet".
int grid_cap(uint32_t* max_blocks) {
  static std::atomic<int> sm_counts[kMaxCachedDevices];  // static storage: zero-initialized
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  int sms = cached ? sm_counts[device].load(std::memory_order_relaxed) : 0;
  if (sms <= 0) {
    status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (status != cudaSuccess) return status;
    if (sms < 1) sms = 1;
    if (cached) sm_counts[device].store(sms, std::memory_order_relaxed);
  }
  *max_blocks = static_cast<uint32_t>(sms) * kBlocksPerSm;
  return cudaSuccess;
}

}  // namespace

int cuda_transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes, void* stream) {
  if (rows == 0 || cols == 0 || chunk_bytes == 0) return cudaSuccess;
  // The buffers hold rows * cols * chunk_bytes bytes: a product that wraps
  // describes no buffer (and would break the 64-bit item count).
  if (cols > SIZE_MAX / rows || chunk_bytes > SIZE_MAX / (rows * cols)) return cudaErrorInvalidValue;
  uint32_t max_blocks = 0;
  if (const int status = grid_cap(&max_blocks)) return status;
  const TransposePlan plan = plan_transpose(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src),
                                            rows, cols, chunk_bytes, max_blocks);
  return with_vector(plan.width, [&](auto tag) {
    using V = decltype(tag);
    transpose_chunks_kernel<V><<<plan.blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<V*>(dst), static_cast<const V*>(src), plan);
    return static_cast<int>(cudaGetLastError());
  });
}

int cuda_copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count, void* stream) {
  uint32_t max_blocks = 0;  // asked for at the first launch: all-empty tables touch no CUDA API
  return for_each_range_batch(dst, src, ranges, count, [&](unsigned width, const RangeBatch& batch) {
    if (max_blocks == 0)
      if (const int status = grid_cap(&max_blocks)) return status;
    const auto blocks = static_cast<uint32_t>(min_u64(batch.tiles, max_blocks));
    return with_vector(width, [&](auto tag) {
      copy_ranges_kernel<decltype(tag)><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<char*>(dst), static_cast<const char*>(src), batch);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

}  // namespace a2a
