// CUDA backend of the MoE kernels (moe/kernels.hpp): everything runs on
// the caller's stream on the current device, with the per-element arithmetic
// of moe/elementwise.hpp, so the CPU tests vouch for the conversions.
// No allocation: the location scan's scratch is the caller's workspace.
//
// Location scan (locate). The T*k choices in Tutel's slot order are cut into
// tiles of `tile` positions (a multiple of 32), one warp per tile:
//   1. tile_histogram: per-tile expert counts, counts[e][tile], one atomic per
//      group of lanes that share an expert (__match_any_sync); also records the
//      first index >= E.
//   2. tile_scan: per expert, an exclusive Blelloch scan of its counts over the
//      tiles (in shared-memory chunks with a carry), giving each tile's first
//      location of that expert and the expert's demand.
//   3. tile_assign: each warp walks its tile in order, 32 positions a step;
//      a choice's location is its tile's next location for the expert plus the
//      number of lower lanes with the same expert, and the lowest such lane
//      advances the tile's counter. Slots are thus handed out in slot order.
// A token_order is checked first (first_seen + order_check: the first entry
// token_order[r] that is out of range or repeats an earlier one), and the scan skips
// any position whose token is out of range, so a bad order cannot make it
// read out of bounds; once order_check has found a bad entry, histogram and
// assignment do nothing at all (route fails), so that locations is left as it
// was, as on the CPU. Then demand and the error record come back to the host
// in one copy, after the one wait for the stream (bounded; the copy itself is
// waited for too). At a fixed capacity (locate_fixed) nothing waits: cap_kernel
// turns the demand into counts, offsets and the dropped choices on the device
// (or, packed, into counts and their running sum),
// the error record stays in the workspace, and fixed_result reads both later.
//
// Data kernels (dispatch, combine, gate_grad). A group of `lanes` threads
// (a power of two up to a warp, sized to the row) handles one row: a scalar
// head up to a 16-byte boundary, 16-byte vector loads and stores (dispatch
// and combine load a batch of vectors before storing any), a scalar tail;
// rows whose pointers are misaligned differently go scalar.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/es_cuda.hpp"
#include "cuda/fp8_cuda.hpp"
#include "cuda/gating_cuda.hpp"
#include "cuda/low_latency_cuda.hpp"
#include "cuda/stream_wait.hpp"
#include "moe/elementwise.hpp"
#include "moe/kernels.hpp"
#include "moe/messages.hpp"

namespace a2a::moe {

namespace {

// ---------------------------------------------------------------------------
// Launch shapes

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Threads per block of every kernel but the scan.
constexpr int kThreads = 256;
// Grid-stride kernels launch at most this many blocks per SM (at most 8 of
// 256 threads are resident on sm_80 / sm_90): enough to balance uneven rows.
constexpr int kBlocksPerSm = 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for `items` work items of which one block takes `per_block`.
unsigned grid_for(int64_t items, int64_t per_block, int max_blocks) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(items, per_block), max_blocks)));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------------------
// Location scan

// Positions per tile: 512, doubled until there are at most kMaxTiles tiles
// (which keeps >= 2048 warps busy on big inputs) and the per-tile counts,
// E * tiles * 8 bytes, fit in kMaxTileCountBytes (many experts get fewer,
// longer tiles instead of a huge workspace).
constexpr int64_t kMinTile = 512;
constexpr int64_t kMaxTiles = 4096;
constexpr int64_t kMaxTileCountBytes = int64_t{64} << 20;
// The scan: one block per expert, kScanChunk tiles per round.
constexpr int kScanThreads = 512;
constexpr int kScanChunk = 2 * kScanThreads;

// The error record at the head of the host-bound block; unset entries stay
// all ones (the memset), which atomicMin leaves to the smallest offender.
// kDropped: a fixed-capacity route's dropped choices (locate_fixed; cap_kernel writes it).
enum : int {
  kBadChoice = 0,
  kBadChoiceValue = 1,
  kBadOrderEntry = 2,
  kBadOrderValue = 3,
  kDropped = 4,
  kRecordSize = 5,
};
constexpr unsigned long long kUnset = ~0ull;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Where everything lives in the locate workspace (offsets from its first
// 256-byte boundary; the size includes the slack to reach it).
struct LocateLayout {
  int64_t positions = 0;
  int64_t tile = kMinTile;
  int64_t tiles = 0;
  size_t record = 0;       // kRecordSize error words, then demand[E]: copied to the host together
  size_t tile_counts = 0;  // int64 [E][tiles]: counts, then each tile's next location
  size_t first_seen = 0;   // uint64 [T]: the first rank of each token in token_order
  size_t total = 0;
};

LocateLayout locate_layout(int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  LocateLayout layout;
  layout.positions = num_tokens * top_k;
  const int64_t max_tiles =
      std::max<int64_t>(1, std::min<int64_t>(kMaxTiles, kMaxTileCountBytes / (8 * std::max<int64_t>(1, num_experts))));
  while (ceil_div(layout.positions, layout.tile) > max_tiles) layout.tile *= 2;
  layout.tiles = ceil_div(layout.positions, layout.tile);
  const size_t E = static_cast<size_t>(num_experts);
  layout.record = 0;
  layout.tile_counts = layout.record + align_up((kRecordSize + E) * sizeof(int64_t));
  layout.first_seen = layout.tile_counts + align_up(E * static_cast<size_t>(layout.tiles) * sizeof(int64_t));
  layout.total = kAlign + layout.first_seen + align_up(static_cast<size_t>(num_tokens) * sizeof(int64_t));
  return layout;
}

// The choice at slot position p, or -1 when token_order maps it to a token
// out of range (the order check reports that; skipping keeps reads in bounds).
__device__ __forceinline__ int64_t choice_in_range(int64_t p, int64_t T, int64_t k, const int64_t* order) {
  if (order != nullptr) {
    const int64_t t = order[p % T];
    if (t < 0 || t >= T) return -1;
  }
  return choice_at(p, T, k, order);
}

__global__ void __launch_bounds__(kThreads)
    first_seen_kernel(const int64_t* __restrict__ order, int64_t T, unsigned long long* __restrict__ first_seen) {
  for (int64_t r = global_thread(); r < T; r += thread_count()) {
    const int64_t t = order[r];
    if (t >= 0 && t < T) atomicMin(&first_seen[t], static_cast<unsigned long long>(r));
  }
}

// Entry r of token_order is bad when it is out of range or an earlier entry holds the same token.
__global__ void __launch_bounds__(kThreads)
    order_check_kernel(const int64_t* __restrict__ order, int64_t T,
                       const unsigned long long* __restrict__ first_seen, unsigned long long* record) {
  for (int64_t r = global_thread(); r < T; r += thread_count()) {
    const int64_t t = order[r];
    if (t < 0 || t >= T || first_seen[t] != static_cast<unsigned long long>(r))
      atomicMin(&record[kBadOrderEntry], static_cast<unsigned long long>(r));
  }
}

// Every loop below is uniform across a warp (tile and step depend only on the
// warp), as __match_any_sync with a full mask requires.
__global__ void __launch_bounds__(kThreads)
    tile_histogram_kernel(const void* __restrict__ indices, a2a_dtype_t index_dtype, int64_t T, int64_t k,
                          int64_t E, const int64_t* __restrict__ order, int64_t positions, int64_t tile,
                          int64_t tiles, unsigned long long* __restrict__ tile_counts, unsigned long long* record) {
  if (order != nullptr && record[kBadOrderEntry] != kUnset) return;  // see tile_assign_kernel
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = thread_count() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < tiles; w += warps) {
    const int64_t end = min(w * tile + tile, positions);
    for (int64_t base = w * tile; base < end; base += kWarp) {
      const int64_t p = base + lane;
      int64_t expert = -1;  // -1: nothing to count on this lane
      if (p < end) {
        const int64_t choice = choice_in_range(p, T, k, order);
        if (choice >= 0) {
          const int64_t e = load_index(indices, index_dtype, choice);
          if (e >= E)
            atomicMin(&record[kBadChoice], static_cast<unsigned long long>(choice));
          else if (e >= 0)
            expert = e;
        }
      }
      const unsigned same = __match_any_sync(kFullMask, static_cast<unsigned long long>(expert));
      if (expert >= 0 && lane == __ffs(same) - 1)
        atomicAdd(&tile_counts[expert * tiles + w], static_cast<unsigned long long>(__popc(same)));
    }
  }
}

// In place over counts[e][0..tiles): exclusive prefix sums, per expert; the
// expert's total goes to demand[e]. Work-efficient (Blelloch) up-sweep and
// down-sweep over kScanChunk tiles at a time; a carry joins the chunks.
__global__ void __launch_bounds__(kScanThreads)
    tile_scan_kernel(int64_t* __restrict__ tile_counts, int64_t tiles, int64_t E, int64_t* __restrict__ demand) {
  __shared__ int64_t sums[kScanChunk];
  const int tid = threadIdx.x;
  for (int64_t e = blockIdx.x; e < E; e += gridDim.x) {  // uniform across the block
    int64_t* counts = tile_counts + e * tiles;
    int64_t carry = 0;
    for (int64_t first = 0; first < tiles; first += kScanChunk) {
      const int n = static_cast<int>(min(static_cast<int64_t>(kScanChunk), tiles - first));
      for (int i = tid; i < kScanChunk; i += kScanThreads) sums[i] = i < n ? counts[first + i] : 0;
      __syncthreads();
      int stride = 1;
      for (int active = kScanChunk / 2; active > 0; active /= 2) {  // up-sweep: partial sums in a tree
        if (tid < active) sums[stride * (2 * tid + 2) - 1] += sums[stride * (2 * tid + 1) - 1];
        stride *= 2;
        __syncthreads();
      }
      const int64_t chunk_total = sums[kScanChunk - 1];
      __syncthreads();
      if (tid == 0) sums[kScanChunk - 1] = 0;
      __syncthreads();
      for (int active = 1; active < kScanChunk; active *= 2) {  // down-sweep: tree to exclusive sums
        stride /= 2;
        if (tid < active) {
          const int left = stride * (2 * tid + 1) - 1, right = stride * (2 * tid + 2) - 1;
          const int64_t left_sum = sums[left];
          sums[left] = sums[right];
          sums[right] += left_sum;
        }
        __syncthreads();
      }
      for (int i = tid; i < n; i += kScanThreads) counts[first + i] = carry + sums[i];
      carry += chunk_total;
      __syncthreads();  // before the next chunk overwrites sums
    }
    if (tid == 0) demand[e] = carry;
  }
}

// next[e][tile]: the tile's next location of expert e (from tile_scan); the
// warp owning the tile advances it as it hands locations out.
__global__ void __launch_bounds__(kThreads)
    tile_assign_kernel(const void* __restrict__ indices, a2a_dtype_t index_dtype, int64_t T, int64_t k, int64_t E,
                       const int64_t* __restrict__ order, int64_t positions, int64_t tile, int64_t tiles,
                       int64_t* next, int64_t* __restrict__ locations, const unsigned long long* record) {
  // A token_order that repeats a token maps two positions to one choice, whose
  // location both would write, unordered (a data race, found by
  // tools/cuda_emulation): with a bad order, route fails, so write nothing.
  if (order != nullptr && record[kBadOrderEntry] != kUnset) return;
  const int lane = threadIdx.x % kWarp;
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t warps = thread_count() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < tiles; w += warps) {
    const int64_t end = min(w * tile + tile, positions);
    for (int64_t base = w * tile; base < end; base += kWarp) {
      const int64_t p = base + lane;
      int64_t choice = -1, expert = -1;
      if (p < end) {
        choice = choice_in_range(p, T, k, order);
        if (choice >= 0) {
          const int64_t e = load_index(indices, index_dtype, choice);
          if (e >= 0 && e < E) expert = e;  // >= E is reported from the histogram pass
        }
      }
      const unsigned same = __match_any_sync(kFullMask, static_cast<unsigned long long>(expert));
      volatile int64_t* counter = expert >= 0 ? next + expert * tiles + w : nullptr;
      const int64_t start = expert >= 0 ? *counter : 0;
      if (choice >= 0) locations[choice] = expert >= 0 ? start + __popc(same & lower_lanes) : -1;
      __syncwarp();  // every lane has read its counter before the leaders advance them
      if (expert >= 0 && (same & lower_lanes) == 0) *counter = start + __popc(same);
      __syncwarp();  // and the advance is visible to the next step
    }
  }
}

// Fills in the offending values of the error record (one thread).
__global__ void error_values_kernel(const void* __restrict__ indices, a2a_dtype_t index_dtype,
                                    const int64_t* __restrict__ order, unsigned long long* record) {
  if (record[kBadChoice] != kUnset)
    record[kBadChoiceValue] =
        static_cast<unsigned long long>(load_index(indices, index_dtype, static_cast<int64_t>(record[kBadChoice])));
  if (order != nullptr && record[kBadOrderEntry] != kUnset)
    record[kBadOrderValue] = static_cast<unsigned long long>(order[record[kBadOrderEntry]]);
}

// The packed layout's tables from the demand (one block): counts[e] =
// demand[e], expert_offsets[e] = the demand of the experts before e,
// expert_offsets[E] = `rows` (T*k, a bound), and nothing dropped. Each thread
// takes a run of consecutive experts: it sums its run, the block scans the
// sums (the same number of barriers whatever E), and the thread writes its
// run's offsets from its exclusive prefix. Integer sums: the CPU's values.
__device__ void packed_tables(const int64_t* __restrict__ demand, int64_t E, int64_t rows,
                              int64_t* __restrict__ counts, int64_t* __restrict__ offsets,
                              unsigned long long* record, int64_t* scan) {
  const int64_t per_thread = (E + blockDim.x - 1) / blockDim.x;
  const int64_t first = min(E, threadIdx.x * per_thread), last = min(E, first + per_thread);
  int64_t run = 0;
  for (int64_t e = first; e < last; ++e) run += demand[e];
  scan[threadIdx.x] = run;
  __syncthreads();
  for (unsigned step = 1; step < blockDim.x; step *= 2) {  // Hillis-Steele: an inclusive scan of the runs
    const int64_t before = threadIdx.x >= step ? scan[threadIdx.x - step] : 0;
    __syncthreads();
    scan[threadIdx.x] += before;
    __syncthreads();
  }
  int64_t next = scan[threadIdx.x] - run;
  for (int64_t e = first; e < last; ++e) {
    counts[e] = demand[e];
    offsets[e] = next;
    next += demand[e];
  }
  if (threadIdx.x == 0) {
    offsets[E] = rows;
    record[kDropped] = 0;
  }
}

// A fixed capacity's tables from the demand (one block): counts[e] =
// min(demand[e], C), expert_offsets[e] = e * C, and the dropped choices;
// C == A2A_CAPACITY_DROPLESS: packed_tables' (rows: T*k).
__global__ void __launch_bounds__(kScanThreads)
    cap_kernel(const int64_t* __restrict__ demand, int64_t E, int64_t capacity, int64_t rows,
               int64_t* __restrict__ counts, int64_t* __restrict__ offsets, unsigned long long* record) {
  __shared__ int64_t dropped[kScanThreads];
  if (capacity == A2A_CAPACITY_DROPLESS) {
    packed_tables(demand, E, rows, counts, offsets, record, dropped);
    return;
  }
  int64_t mine = 0;
  for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) {
    offsets[e] = e * capacity;
    if (e == E) continue;
    const int64_t kept = min(demand[e], capacity);
    counts[e] = kept;
    mine += demand[e] - kept;
  }
  dropped[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kScanThreads / 2; half > 0; half /= 2) {  // a tree sum: the same order every time
    if (static_cast<int>(threadIdx.x) < half) dropped[threadIdx.x] += dropped[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) record[kDropped] = static_cast<unsigned long long>(dropped[0]);
}

// ---------------------------------------------------------------------------
// Rows: scalar head, 16-byte vectors, scalar tail

template <typename T>
struct Vec {
  static_assert(16 % sizeof(T) == 0, "element size must divide 16");
  static constexpr int kSize = static_cast<int>(16 / sizeof(T));
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* src) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  Vec<T> out;
  memcpy(&out, &raw, sizeof raw);
  return out;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* dst, const Vec<T>& in) {
  uint4 raw;
  memcpy(&raw, &in, sizeof raw);
  // __stwb: a plain (write-back) store, but one 16-byte instruction; a
  // dereference gets split into per-element stores once the values are floats.
  __stwb(reinterpret_cast<uint4*>(dst), raw);
}

// Address mod 16, or kMixed when rows that are read or written together
// disagree (then there is no common vector boundary).
constexpr unsigned kMixed = 16;

template <typename T>
__device__ __forceinline__ unsigned misalignment(const T* p) {
  return static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) % 16);
}

__device__ __forceinline__ unsigned common_misalignment(unsigned a, unsigned b) { return a == b ? a : kMixed; }

// A row of n elements: elements [0, head) scalar, then `vectors` 16-byte
// vectors, then scalar to n.
struct RowSplit {
  int64_t head;
  int64_t vectors;
};

template <typename T>
__device__ __forceinline__ RowSplit split_row(unsigned misaligned, int64_t n) {
  constexpr int64_t kSize = Vec<T>::kSize;
  if (misaligned >= 16 || misaligned % sizeof(T) != 0) return {n, 0};
  const int64_t head = min(static_cast<int64_t>((16 - misaligned) % 16 / sizeof(T)), n);
  return {head, (n - head) / kSize};
}

template <typename T>
__device__ __forceinline__ T scale(T value, typename Num<T>::Acc gate) {
  return Num<T>::store(mul_rn(gate, Num<T>::load(value)));
}

// Vectors a lane loads before it stores any. A lane's loads of one row are
// independent, but a store between two of them keeps the compiler from
// issuing the next load early (it cannot prove the rows apart), so a lane
// that loads, stores and loads again has one 16-byte load in flight per
// source, and a row pays a memory latency per vector it holds. In batches, a
// lane has a batch of loads per source in flight. The batches trade
// registers (occupancy) for loads in flight; ptxas for sm_90 (bf16): dispatch
// 32 -> 55 registers at 4, combine 55 -> 78 at 2 (128 at 4, with its eight
// cached sources). Not yet measured on a GPU: 1 is the loop before batches.
constexpr int kDispatchBatch = 4;
constexpr int kCombineBatch = 2;

// Threads per row: enough for one vector each, at most a warp.
int lanes_for(int64_t model_dim, size_t element_size) {
  const int64_t vectors = ceil_div(model_dim, static_cast<int64_t>(16 / element_size));
  int lanes = 1;
  while (lanes < kWarp && lanes < vectors) lanes *= 2;
  return lanes;
}

__device__ __forceinline__ int64_t group_index(int lanes) { return global_thread() / lanes; }
__device__ __forceinline__ int64_t group_count(int lanes) { return thread_count() / lanes; }

// ---------------------------------------------------------------------------
// Dispatch: rows[row(t, j)] = g(t, j) * x[t], and in padded layouts zeros in
// the rows past each expert's count: one launch for both (item i of the loop
// is choice i and row i; a kept row is never a padding row, so no two items
// write the same bytes).

template <typename T, bool kScaled>
__device__ __forceinline__ void dispatch_choice(const a2a_routing_t& r, const T* __restrict__ x, int64_t M,
                                                const void* __restrict__ gates, bool gate_is_data,
                                                T* __restrict__ rows, int lanes, int lane, int64_t choice) {
  using Acc = typename Num<T>::Acc;
  constexpr int64_t kSize = Vec<T>::kSize;
  const int64_t row = kept_row(r, choice);
  if (row < 0) return;
  const T* src = x + choice / r.top_k * M;
  T* dst = rows + row * M;
  const Acc gate = kScaled ? load_gate<T>(gates, gate_is_data, choice) : Acc(1);
  const RowSplit split = split_row<T>(common_misalignment(misalignment(src), misalignment(dst)), M);
  for (int64_t i = lane; i < split.head; i += lanes) dst[i] = kScaled ? scale(src[i], gate) : src[i];
  // kDispatchBatch vectors loaded before any is stored.
  for (int64_t first = lane; first < split.vectors; first += lanes * kDispatchBatch) {
    Vec<T> values[kDispatchBatch];
#pragma unroll
    for (int u = 0; u < kDispatchBatch; ++u)
      if (first + u * lanes < split.vectors) values[u] = load_vec(src + split.head + (first + u * lanes) * kSize);
#pragma unroll
    for (int u = 0; u < kDispatchBatch; ++u) {
      if (first + u * lanes >= split.vectors) continue;
      if (kScaled) {
#pragma unroll
        for (int e = 0; e < kSize; ++e) values[u].v[e] = scale(values[u].v[e], gate);
      }
      store_vec(dst + split.head + (first + u * lanes) * kSize, values[u]);
    }
  }
  for (int64_t i = split.head + split.vectors * kSize + lane; i < M; i += lanes)
    dst[i] = kScaled ? scale(src[i], gate) : src[i];
}

// Row `row` zeroed where it lies past its expert's count.
template <typename T>
__device__ __forceinline__ void zero_if_padding(const a2a_routing_t& r, int64_t M, T* __restrict__ rows, int lanes,
                                                int lane, int64_t row) {
  constexpr int64_t kSize = Vec<T>::kSize;
  const int64_t expert = expert_of_row(r, row);
  if (row - r.expert_offsets[expert] < r.counts[expert]) return;  // a kept row: its choice writes it
  T* dst = rows + row * M;
  const RowSplit split = split_row<T>(misalignment(dst), M);
  for (int64_t i = lane; i < split.head; i += lanes) dst[i] = T{};
  for (int64_t v = lane; v < split.vectors; v += lanes)
    *reinterpret_cast<uint4*>(dst + split.head + v * kSize) = make_uint4(0, 0, 0, 0);
  for (int64_t i = split.head + split.vectors * kSize + lane; i < M; i += lanes) dst[i] = T{};
}

// `padded_rows`: the layout's rows in a padded layout (one capacity, or
// per-expert capacities), 0 when dropless (no padding).
template <typename T, bool kScaled>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(const a2a_routing_t r, const T* __restrict__ x, int64_t M, const void* __restrict__ gates,
                    bool gate_is_data, T* __restrict__ rows, int lanes, int64_t padded_rows) {
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t choices = r.num_tokens * r.top_k;
  const int64_t items = choices > padded_rows ? choices : padded_rows;
  for (int64_t item = group_index(lanes); item < items; item += group_count(lanes)) {
    if (item < choices) dispatch_choice<T, kScaled>(r, x, M, gates, gate_is_data, rows, lanes, lane, item);
    if (item < padded_rows) zero_if_padding<T>(r, M, rows, lanes, lane, item);
  }
}

// ---------------------------------------------------------------------------
// Combine: y[t] = sum over kept j, in j order, of g(t, j) * rows[row(t, j)].

// Up to kChunk of a token's choices at a time: the rows and gates of the kept
// ones (src NULL for the others). The first kChunk are looked up once per
// token and stay in registers; top_k beyond that is rare and is looked up
// again per element.
constexpr int kChunk = 8;

template <typename T>
struct Sources {
  const T* src[kChunk];
  typename Num<T>::Acc gate[kChunk];
};

// Loads the kept choices among t's choices [first, first + kChunk) and folds
// their rows' misalignment into `misaligned`.
template <typename T>
__device__ __forceinline__ Sources<T> gather_sources(const a2a_routing_t& r, const T* rows, int64_t M,
                                                      const void* gates, bool gate_is_data, int64_t t, int64_t first,
                                                      unsigned& misaligned) {
  Sources<T> s;
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    const int64_t j = first + c;
    const int64_t row = j < r.top_k ? kept_row(r, t * r.top_k + j) : -1;
    s.src[c] = nullptr;
    s.gate[c] = 0;
    if (row >= 0) {
      s.src[c] = rows + row * M;
      s.gate[c] = load_gate<T>(gates, gate_is_data, t * r.top_k + j);
      misaligned = common_misalignment(misaligned, misalignment(s.src[c]));
    }
  }
  return s;
}

// acc[e] += sum over the sources, in order, of gate * row[i + e].
template <typename T, int kWidth>
__device__ __forceinline__ void accumulate(const Sources<T>& s, int64_t i, typename Num<T>::Acc (&acc)[kWidth]) {
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    if (s.src[c] == nullptr) continue;
    if (kWidth == 1) {
      acc[0] += mul_rn(s.gate[c], Num<T>::load(s.src[c][i]));
    } else {
      const Vec<T> values = load_vec(s.src[c] + i);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) acc[e] += mul_rn(s.gate[c], Num<T>::load(values.v[e]));
    }
  }
}

// Elements [i, i + kWidth) of y[t] (kWidth 1: scalar; else one vector).
// kMany: top_k > kChunk.
template <typename T, int kWidth, bool kMany>
__device__ __forceinline__ void combine_elements(const a2a_routing_t& r, const T* rows, int64_t M, const void* gates,
                                                 bool gate_is_data, int64_t t, const Sources<T>& cached, T* dst,
                                                 int64_t i) {
  using Acc = typename Num<T>::Acc;
  Acc acc[kWidth];
#pragma unroll
  for (int e = 0; e < kWidth; ++e) acc[e] = Acc(0);
  accumulate<T, kWidth>(cached, i, acc);
  // top_k > kChunk: the later choices are looked up again for every element.
  for (int64_t first = kChunk; kMany && first < r.top_k; first += kChunk) {
    unsigned unused = 0;
    accumulate<T, kWidth>(gather_sources(r, rows, M, gates, gate_is_data, t, first, unused), i, acc);
  }
  if (kWidth == 1) {
    dst[i] = Num<T>::store(acc[0]);
  } else {
    Vec<T> out;
#pragma unroll
    for (int e = 0; e < kWidth; ++e) out.v[e] = Num<T>::store(acc[e]);
    store_vec(dst + i, out);
  }
}

// Vectors [first + u lanes for u < kCombineBatch] (those below `vectors`) of
// y[t], for top_k <= kChunk: every kept source's batch is loaded before
// their products are summed, and the sums stored after the last source (each
// element sums its sources in the order combine_elements does).
template <typename T>
__device__ __forceinline__ void combine_batch(const Sources<T>& s, int64_t head, int64_t first, int lanes,
                                              int64_t vectors, T* dst) {
  using Acc = typename Num<T>::Acc;
  constexpr int kSize = Vec<T>::kSize;
  Acc acc[kCombineBatch][kSize];
#pragma unroll
  for (int u = 0; u < kCombineBatch; ++u)
#pragma unroll
    for (int e = 0; e < kSize; ++e) acc[u][e] = Acc(0);
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    if (s.src[c] == nullptr) continue;
    Vec<T> values[kCombineBatch];
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u)
      if (first + u * lanes < vectors) values[u] = load_vec(s.src[c] + head + (first + u * lanes) * kSize);
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u) {
      if (first + u * lanes >= vectors) continue;  // not loaded, not stored
#pragma unroll
      for (int e = 0; e < kSize; ++e) acc[u][e] += mul_rn(s.gate[c], Num<T>::load(values[u].v[e]));
    }
  }
#pragma unroll
  for (int u = 0; u < kCombineBatch; ++u) {
    if (first + u * lanes >= vectors) continue;
    Vec<T> out;
#pragma unroll
    for (int e = 0; e < kSize; ++e) out.v[e] = Num<T>::store(acc[u][e]);
    store_vec(dst + head + (first + u * lanes) * kSize, out);
  }
}

// kMany (top_k > kChunk) is a separate instantiation, so that the common
// case carries no registers for the rare one.
template <typename T, bool kMany>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const a2a_routing_t r, const T* __restrict__ rows, int64_t M, const void* __restrict__ gates,
                   bool gate_is_data, T* __restrict__ y, int lanes) {
  constexpr int kSize = Vec<T>::kSize;
  const int lane = threadIdx.x & (lanes - 1);
  for (int64_t t = group_index(lanes); t < r.num_tokens; t += group_count(lanes)) {
    T* dst = y + t * M;
    unsigned misaligned = misalignment(dst);
    const Sources<T> cached = gather_sources(r, rows, M, gates, gate_is_data, t, 0, misaligned);
    for (int64_t first = kChunk; kMany && first < r.top_k; first += kChunk)  // only the alignment of the rest
      (void)gather_sources(r, rows, M, gates, gate_is_data, t, first, misaligned);
    const RowSplit split = split_row<T>(misaligned, M);
    for (int64_t i = lane; i < split.head; i += lanes)
      combine_elements<T, 1, kMany>(r, rows, M, gates, gate_is_data, t, cached, dst, i);
    if (kMany) {
      for (int64_t v = lane; v < split.vectors; v += lanes)
        combine_elements<T, kSize, kMany>(r, rows, M, gates, gate_is_data, t, cached, dst, split.head + v * kSize);
    } else {
      for (int64_t first = lane; first < split.vectors; first += lanes * kCombineBatch)
        combine_batch<T>(cached, split.head, first, lanes, split.vectors, dst);
    }
    for (int64_t i = split.head + split.vectors * kSize + lane; i < M; i += lanes)
      combine_elements<T, 1, kMany>(r, rows, M, gates, gate_is_data, t, cached, dst, i);
  }
}

// ---------------------------------------------------------------------------
// Gate gradient: grad[t*k + j] = dot(tokens[t], rows[row(t, j)]), 0 when not kept.

// `lanes` threads per choice; the loop runs warp by warp (every lane takes
// part in the shuffles, also past the last choice).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    gate_grad_kernel(const a2a_routing_t r, const T* __restrict__ tokens, const T* __restrict__ rows, int64_t M,
                     bool gate_is_data, void* __restrict__ grad_gates, int lanes) {
  using Acc = typename Num<T>::Acc;
  constexpr int64_t kSize = Vec<T>::kSize;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t per_warp = kWarp / lanes;
  const int64_t choices = r.num_tokens * r.top_k;
  const int64_t warps = thread_count() / kWarp;
  for (int64_t first = global_thread() / kWarp * per_warp; first < choices; first += warps * per_warp) {
    const int64_t choice = first + (threadIdx.x % kWarp) / lanes;
    const int64_t row = choice < choices ? kept_row(r, choice) : -1;
    Acc acc = Acc(0);
    if (row >= 0) {
      const T* a = tokens + choice / r.top_k * M;
      const T* b = rows + row * M;
      const RowSplit split = split_row<T>(common_misalignment(misalignment(a), misalignment(b)), M);
      for (int64_t i = lane; i < split.head; i += lanes) acc += Num<T>::load(a[i]) * Num<T>::load(b[i]);
      for (int64_t v = lane; v < split.vectors; v += lanes) {
        const int64_t i = split.head + v * kSize;
        const Vec<T> va = load_vec(a + i), vb = load_vec(b + i);
#pragma unroll
        for (int e = 0; e < kSize; ++e) acc += Num<T>::load(va.v[e]) * Num<T>::load(vb.v[e]);
      }
      for (int64_t i = split.head + split.vectors * kSize + lane; i < M; i += lanes)
        acc += Num<T>::load(a[i]) * Num<T>::load(b[i]);
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(kFullMask, acc, offset);
    if (choice < choices && lane == 0) store_gate<T>(grad_gates, gate_is_data, choice, acc);
  }
}

// ---------------------------------------------------------------------------
// Host side

class CudaKernels final : public Kernels {
 public:
  // Touches no CUDA API (a workspace size query needs no device).
  CudaKernels(cudaStream_t stream, double timeout_s) : stream_(stream), timeout_s_(timeout_s) {}

  const char* name() const override { return "cuda"; }

  size_t locate_workspace_size(int64_t num_tokens, int64_t top_k, int64_t num_experts) const override {
    return locate_layout(num_tokens, top_k, num_experts).total;
  }

  void locate(const RouteProblem& p, void* workspace, size_t /*workspace_bytes: checked by moe/moe.cpp*/,
              int64_t* locations, std::vector<int64_t>& demand) override {
    const int64_t T = p.num_tokens, k = p.top_k, E = p.num_experts;
    const LocateLayout layout = locate_layout(T, k, E);
    demand.assign(static_cast<size_t>(E), 0);
    if (layout.tiles == 0 && (p.token_order == nullptr || T == 0)) return;  // nothing to scan or check
    ScanRecord scan = enqueue_scan(p, workspace, locations);

    // The record and (when scanned) the demand, in one copy. The kernels are
    // waited for first, bounded: a copy to pageable memory returns only once
    // it is done, so behind a stuck stream it would block before any timeout.
    const std::vector<unsigned long long> host =
        read_record(scan.record, kRecordSize + (layout.tiles > 0 ? static_cast<size_t>(E) : 0), "the location scan");
    raise_scan_fault(fault_of(host), T, k, E);
    if (layout.tiles > 0)
      for (int64_t e = 0; e < E; ++e) demand[e] = static_cast<int64_t>(host[kRecordSize + e]);
  }

  void locate_fixed(const RouteProblem& p, void* workspace, size_t /*workspace_bytes: checked by moe/moe.cpp*/,
                    int64_t capacity, int64_t* locations, int64_t* counts, int64_t* expert_offsets) override {
    const int64_t T = p.num_tokens, k = p.top_k, E = p.num_experts;
    // With a bad token_order the scan writes no location: every choice is then not routed.
    if (p.token_order != nullptr && T * k > 0)
      check_cuda(cudaMemsetAsync(locations, 0xff, static_cast<size_t>(T * k) * sizeof(int64_t), stream_),
                 "cudaMemsetAsync");
    ScanRecord scan = enqueue_scan(p, workspace, locations);
    if (locate_layout(T, k, E).tiles == 0)  // nothing scanned: no demand
      check_cuda(cudaMemsetAsync(scan.demand, 0, static_cast<size_t>(E) * sizeof(int64_t), stream_),
                 "cudaMemsetAsync");
    cap_kernel<<<1, kScanThreads, 0, stream_>>>(scan.demand, E, capacity, T * k, counts, expert_offsets,
                                                scan.record);
    check_launch("cap_kernel");
  }

  std::pair<ScanFault, int64_t> fixed_result(const void* workspace) override {
    const std::vector<unsigned long long> host =
        read_record(record_in(const_cast<void*>(workspace)), kRecordSize, "the fixed-capacity route");
    return {fault_of(host), static_cast<int64_t>(host[kDropped])};
  }

  void upload(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    // From pageable memory, cudaMemcpyAsync returns once the bytes are staged;
    // from page-locked memory it returns at once, and since the caller may
    // reuse host_src when this returns, the copy is waited for then.
    cudaPointerAttributes attributes{};
    bool page_locked = false;
    if (cudaPointerGetAttributes(&attributes, host_src) == cudaSuccess)
      page_locked = attributes.type == cudaMemoryTypeHost;
    else
      (void)cudaGetLastError();  // unknown to CUDA: treated as pageable; the copy below reports real trouble
    check_cuda(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (host to device)");
    if (page_locked) wait("a copy of the layout to the device");
  }

  void dispatch(const a2a_routing_t& r, const void* x, a2a_dtype_t dtype, int64_t model_dim, const void* gates,
                a2a_dtype_t gate_dtype, void* rows) override {
    const bool gate_is_data = gates != nullptr && gate_dtype == dtype;
    with_float_type("dispatch", dtype, [&](auto tag) {
      using T = decltype(tag);
      if (model_dim == 0) return;
      const int lanes = lanes_for(model_dim, sizeof(T));
      const int64_t per_block = kThreads / lanes;
      const int64_t padded_rows = r.capacity != A2A_CAPACITY_DROPLESS ? r.num_rows : 0;
      const int64_t items = std::max(r.num_tokens * r.top_k, padded_rows);
      if (items == 0) return;
      const unsigned blocks = grid_for(items, per_block, max_blocks());
      if (gates != nullptr)
        dispatch_kernel<T, true><<<blocks, kThreads, 0, stream_>>>(r, static_cast<const T*>(x), model_dim, gates,
                                                                    gate_is_data, static_cast<T*>(rows), lanes,
                                                                    padded_rows);
      else
        dispatch_kernel<T, false><<<blocks, kThreads, 0, stream_>>>(r, static_cast<const T*>(x), model_dim, nullptr,
                                                                     false, static_cast<T*>(rows), lanes, padded_rows);
      check_launch("dispatch_kernel");
    });
  }

  void combine(const a2a_routing_t& r, const void* rows, a2a_dtype_t dtype, int64_t model_dim, const void* gates,
               a2a_dtype_t gate_dtype, void* y) override {
    const bool gate_is_data = gates != nullptr && gate_dtype == dtype;
    with_float_type("combine", dtype, [&](auto tag) {
      using T = decltype(tag);
      if (model_dim == 0 || r.num_tokens == 0) return;
      const int lanes = lanes_for(model_dim, sizeof(T));
      const unsigned blocks = grid_for(r.num_tokens, kThreads / lanes, max_blocks());
      if (r.top_k <= kChunk)
        combine_kernel<T, false><<<blocks, kThreads, 0, stream_>>>(r, static_cast<const T*>(rows), model_dim, gates,
                                                                    gate_is_data, static_cast<T*>(y), lanes);
      else
        combine_kernel<T, true><<<blocks, kThreads, 0, stream_>>>(r, static_cast<const T*>(rows), model_dim, gates,
                                                                   gate_is_data, static_cast<T*>(y), lanes);
      check_launch("combine_kernel");
    });
  }

  void gate_grad(const a2a_routing_t& r, const void* tokens, const void* rows, a2a_dtype_t dtype, int64_t model_dim,
                 a2a_dtype_t gate_dtype, void* grad_gates) override {
    const bool gate_is_data = gate_dtype == dtype;
    with_float_type("gate_grad", dtype, [&](auto tag) {
      using T = decltype(tag);
      const int64_t choices = r.num_tokens * r.top_k;
      if (choices == 0) return;  // with model_dim 0 the kernel still writes the zeros
      const int lanes = lanes_for(model_dim, sizeof(T));
      gate_grad_kernel<T><<<grid_for(choices, kThreads / lanes, max_blocks()), kThreads, 0, stream_>>>(
          r, static_cast<const T*>(tokens), static_cast<const T*>(rows), model_dim, gate_is_data, grad_gates, lanes);
      check_launch("gate_grad_kernel");
    });
  }

  // The expert-specific operators: cuda/es_cuda.cu.
  void es_scatter_slots(const RouteProblem& problem, const int64_t* locations, const int64_t* expert_starts,
                        int64_t num_slots, int64_t* slots) override {
    cuda_es_scatter_slots(es_launch(), problem, locations, expert_starts, num_slots, slots);
  }

  void esmm(const a2a_es_index_t& index, const EsMatmul& problem) override {
    cuda_esmm(es_launch(), index, problem);
  }

  void ess(const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates, a2a_dtype_t dtype,
           void* out) override {
    cuda_ess(es_launch(), index, x, gates, dtype, out);
  }

  void estmm(const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b, const EsGates& gates,
             a2a_dtype_t dtype, void* out) override {
    cuda_estmm(es_launch(), index, a, b, gates, dtype, out);
  }

  void top_k_gate(const a2a_top_k_gate_t& gate, const void* logits, void* scores, int64_t* indices, void* gates,
                  void* share, void* l_aux, void* workspace) override {
    cuda_top_k_gate(es_launch(), gate, logits, scores, indices, gates, share, l_aux, workspace);
  }
  void top_k_gate_backward(const a2a_top_k_gate_t& gate, const void* scores, const int64_t* indices,
                           const void* share, const void* d_gates, const void* d_l_aux, void* d_logits) override {
    cuda_top_k_gate_backward(es_launch(), gate, scores, indices, share, d_gates, d_l_aux, d_logits);
  }
  void quantize_fp8(const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows) override {
    cuda_quantize_fp8(es_launch(), x, dtype, rows);
  }

  void dequantize_fp8(const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y) override {
    cuda_dequantize_fp8(es_launch(), rows, dtype, y);
  }

  void low_latency_pack(const LowLatencyLayout& l, const void* x, int64_t num_tokens, const void* indices,
                        a2a_dtype_t index_dtype, uint32_t sequence, char* workspace, int64_t* /*sent: on the device*/)
      override {
    cuda_low_latency_pack(es_launch(), l, x, num_tokens, indices, index_dtype, sequence, workspace);
  }

  void low_latency_reject(const LowLatencyLayout& l, uint32_t kind, uint32_t sequence, char* workspace) override {
    cuda_low_latency_reject(es_launch(), l, kind, sequence, workspace);
  }

  void low_latency_unpack(const LowLatencyLayout& l, uint32_t sequence, char* workspace, void* recv,
                          int64_t* recv_counts, int64_t* /*received: on the device*/) override {
    cuda_low_latency_unpack(es_launch(), l, sequence, workspace, recv, recv_counts);
  }

  void low_latency_return(const LowLatencyLayout& l, const void* expert_out, uint32_t sequence,
                          char* workspace) override {
    cuda_low_latency_return(es_launch(), l, expert_out, sequence, workspace);
  }

  void low_latency_combine(const LowLatencyLayout& l, int64_t num_tokens, const void* gates, a2a_dtype_t gate_dtype,
                           uint32_t sequence, char* workspace, void* y, const int64_t* /*sent*/) override {
    cuda_low_latency_combine(es_launch(), l, num_tokens, gates, gate_dtype, sequence, workspace, y);
  }

  LowLatencyStatus low_latency_status(const LowLatencyLayout& l, const char* workspace) override {
    return cuda_low_latency_status(es_launch(), l, workspace, timeout_s_);
  }

 private:
  // Where a locate's record and demand live in its workspace.
  struct ScanRecord {
    unsigned long long* record;
    int64_t* demand;
  };

  static unsigned long long* record_in(void* workspace) {
    const uintptr_t start = (reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) / kAlign * kAlign;
    return reinterpret_cast<unsigned long long*>(start);  // layout.record is 0
  }

  // The order check and the scan (see the file's head), on the stream.
  ScanRecord enqueue_scan(const RouteProblem& p, void* workspace, int64_t* locations) {
    const int64_t T = p.num_tokens, k = p.top_k, E = p.num_experts;
    const LocateLayout layout = locate_layout(T, k, E);
    char* base = reinterpret_cast<char*>(record_in(workspace));
    auto* record = reinterpret_cast<unsigned long long*>(base + layout.record);
    auto* demand_device = reinterpret_cast<int64_t*>(record + kRecordSize);
    auto* tile_counts = reinterpret_cast<int64_t*>(base + layout.tile_counts);
    auto* first_seen = reinterpret_cast<unsigned long long*>(base + layout.first_seen);
    const unsigned warp_blocks = grid_for(layout.tiles, kThreads / kWarp, max_blocks());
    const bool check_order = p.token_order != nullptr && T > 0;

    check_cuda(cudaMemsetAsync(record, 0xff, kRecordSize * sizeof(unsigned long long), stream_), "cudaMemsetAsync");
    if (check_order) {
      check_cuda(cudaMemsetAsync(first_seen, 0xff, static_cast<size_t>(T) * sizeof(unsigned long long), stream_),
                 "cudaMemsetAsync");
      const unsigned blocks = grid_for(T, kThreads, max_blocks());
      first_seen_kernel<<<blocks, kThreads, 0, stream_>>>(p.token_order, T, first_seen);
      check_launch("first_seen_kernel");
      order_check_kernel<<<blocks, kThreads, 0, stream_>>>(p.token_order, T, first_seen, record);
      check_launch("order_check_kernel");
    }
    if (layout.tiles > 0) {
      check_cuda(cudaMemsetAsync(tile_counts, 0, static_cast<size_t>(E * layout.tiles) * sizeof(int64_t), stream_),
                 "cudaMemsetAsync");
      tile_histogram_kernel<<<warp_blocks, kThreads, 0, stream_>>>(
          p.indices, p.index_dtype, T, k, E, p.token_order, layout.positions, layout.tile, layout.tiles,
          reinterpret_cast<unsigned long long*>(tile_counts), record);
      check_launch("tile_histogram_kernel");
      tile_scan_kernel<<<grid_for(E, 1, max_blocks()), kScanThreads, 0, stream_>>>(tile_counts, layout.tiles, E,
                                                                                   demand_device);
      check_launch("tile_scan_kernel");
      tile_assign_kernel<<<warp_blocks, kThreads, 0, stream_>>>(p.indices, p.index_dtype, T, k, E, p.token_order,
                                                                layout.positions, layout.tile, layout.tiles,
                                                                tile_counts, locations, record);
      check_launch("tile_assign_kernel");
    }
    error_values_kernel<<<1, 1, 0, stream_>>>(p.indices, p.index_dtype, p.token_order, record);
    check_launch("error_values_kernel");
    return {record, demand_device};
  }

  // `words` of a record to the host, after waiting (bounded) for the stream
  // and then for the copy.
  std::vector<unsigned long long> read_record(const unsigned long long* record, size_t words, const char* what) {
    wait(what);
    std::vector<unsigned long long> host(words);
    check_cuda(cudaMemcpyAsync(host.data(), record, words * sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                               stream_),
               "cudaMemcpyAsync (device to host)");
    wait(cat("the copy of ", what, "'s counts").c_str());
    return host;
  }

  static ScanFault fault_of(const std::vector<unsigned long long>& record) {
    ScanFault fault;
    if (record[kBadOrderEntry] != kUnset) {
      fault.bad_order_entry = static_cast<int64_t>(record[kBadOrderEntry]);
      fault.bad_order_value = static_cast<int64_t>(record[kBadOrderValue]);
    }
    if (record[kBadChoice] != kUnset) {
      fault.bad_choice = static_cast<int64_t>(record[kBadChoice]);
      fault.bad_choice_value = static_cast<int64_t>(record[kBadChoiceValue]);
    }
    return fault;
  }

  // Waits for the stream, bounded like every wait (route's two waits): work
  // enqueued before route, e.g. a collective whose peer never comes, must not
  // hang it.
  void wait(const char* what) {
    if (!wait_for_stream(stream_, timeout_s_))
      fail(A2A_ERROR_TIMEOUT, "route: the CUDA stream did not finish ", what, " within ", timeout_s_,
           " s (A2A_TIMEOUT_S); work enqueued on that stream before route (e.g. a collective waiting for a peer) "
           "may be stuck");
  }

  // The grid cap of the current device, found on the first launch; its
  // errors are the first to say that there is no usable device or driver.
  int max_blocks() {
    if (max_blocks_ == 0) max_blocks_ = multiprocessor_count(current_cuda_device()) * kBlocksPerSm;
    return max_blocks_;
  }

  EsLaunch es_launch() { return EsLaunch{stream_, max_blocks()}; }

  cudaStream_t stream_;
  double timeout_s_;
  int max_blocks_ = 0;
};

}  // namespace

std::unique_ptr<Kernels> make_cuda_kernels(void* stream, double timeout_s) {
  return std::make_unique<CudaKernels>(static_cast<cudaStream_t>(stream), timeout_s);
}

}  // namespace a2a::moe
