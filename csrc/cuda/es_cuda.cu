// CUDA kernels of the expert-specific operators (Hexa-MoE, Section 3.2 and
// Appendix B). Each reads an expert's choices through the re-index vector
// (a2a_es_index_t): slot s of expert e holds a choice id c (or -1 for
// padding), and the operand rows of c are found with es_row.
//
// ESMM (Figure 3b) is a tiled matmul whose M dimension is the slots: a block
// takes 64 consecutive slots and a block of output columns, finds the expert
// of those slots (a binary search over expert_starts), gathers the x rows of
// their choices (zeros for padding), loads that one expert's weight block,
// accumulates over K in shared-memory steps, and writes row c of the output
// with the bias and the gate applied. The 64 slots need not be one expert's:
// a block walks the experts its slots span, one segment each, so any `tile`
// of the index works (with tile a multiple of 64, every block has one
// segment, and blocks over padding only return). float16 / bfloat16 use
// tensor cores (WMMA, fp32 accumulators) on sm_80 and newer; float32 /
// float64, and 16-bit floats where no sm_80 code was built, use a 4x4
// register micro-tile per thread on CUDA cores. y by token with top_k > 1 goes through the caller's
// workspace: the per-choice results (float32; float64 for float64) and then
// sum_choices_kernel adds each token's k rows in j order, deterministically.
//
// ESS (Figure 3c): a thread owns one column of one expert and adds the
// expert's slots in slot order. ESTMM (Figure 3d): a block owns an (A, B)
// tile of one expert and walks the expert's slots in steps of 16, each
// thread adding its 4x4 outputs in slot order. Neither splits an expert's
// slots over blocks, so every sum has one fixed order, and ESS adds its terms
// as the CPU does (products rounded on their own, mul_rn).
//
// The kernels trust the index's structure (a2a_es_index builds it), except
// that a choice id outside [0, T*k) or a slot past its expert is never
// followed, so a damaged index cannot make them read or write out of bounds.
#include "cuda/es_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_math.cuh"
#include "moe/elementwise.hpp"

namespace a2a::moe {

namespace {

constexpr int kThreads = 256;
// Grid dimensions y and z are limited to 65535; kernels loop over the rest.
constexpr int64_t kMaxGridYZ = 65535;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

unsigned grid_yz(int64_t items) { return static_cast<unsigned>(std::min(items, kMaxGridYZ)); }

unsigned grid_for(int64_t items, int64_t per_block, int max_blocks) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(items, per_block), max_blocks)));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// The expert whose sub-vector holds slot s (0 <= s < expert_starts[E]): the
// last e with expert_starts[e] <= s, which skips empty experts.
__device__ __forceinline__ int64_t expert_of_slot(const int64_t* expert_starts, int64_t num_experts, int64_t s) {
  int64_t low = 0, high = num_experts;  // expert_starts[low] <= s < expert_starts[high]
  while (high - low > 1) {
    const int64_t middle = low + (high - low) / 2;
    if (expert_starts[middle] <= s)
      low = middle;
    else
      high = middle;
  }
  return low;
}

// The choice at slot s (relative to nothing: an absolute slot), or -1 for
// padding and for ids out of range.
__device__ __forceinline__ int64_t slot_choice(const int64_t* slots, int64_t s, int64_t choices) {
  const int64_t c = slots[s];
  return c >= 0 && c < choices ? c : -1;
}

// Four accumulators read from shared memory in one access (LDS.128 for float).
template <typename Acc>
struct alignas(4 * sizeof(Acc)) Quad {
  Acc v[4];
};

template <typename Acc>
__device__ __forceinline__ Quad<Acc> load_quad(const Acc* p) {
  return *reinterpret_cast<const Quad<Acc>*>(p);
}

// A result in the output's type: the data's storage type, or the accumulator
// (the top_k > 1 workspace).
template <typename T, typename Out>
__device__ __forceinline__ Out to_out(typename Num<T>::Acc value) {
  if constexpr (std::is_same_v<Out, T>)
    return Num<T>::store(value);
  else
    return value;
}

// ---------------------------------------------------------------------------
// The re-index vector: slots = -1 (a memset), then each routed choice at its
// expert's start plus its location.

__global__ void __launch_bounds__(kThreads)
    scatter_slots_kernel(const void* __restrict__ indices, a2a_dtype_t index_dtype, int64_t choices,
                         int64_t num_experts, const int64_t* __restrict__ locations,
                         const int64_t* __restrict__ expert_starts, int64_t* __restrict__ slots) {
  for (int64_t c = global_thread(); c < choices; c += thread_count()) {
    const int64_t e = load_index(indices, index_dtype, c);
    const int64_t location = locations[c];
    if (e < 0 || e >= num_experts || location < 0) continue;
    const int64_t s = expert_starts[e] + location;
    if (s < expert_starts[e + 1]) slots[s] = c;
  }
}

// ---------------------------------------------------------------------------
// ESMM

template <typename T>
struct EsmmArgs {
  const int64_t* slots;
  const int64_t* expert_starts;
  const int64_t* counts;
  int64_t num_slots;
  int64_t num_experts;
  int64_t top_k;
  int64_t choices;  // T * k
  const T* x;
  a2a_es_rows_t x_rows;
  int64_t k;  // K: x's width
  const T* w;
  const T* bias;  // (E, N) or null
  const void* gates;
  bool gate_is_data;
  int64_t n;  // N: y's width
};

// Calls segment(e, begin, end) for every run [begin, end) of routed slots of
// one expert e among slots [first, last): the block's slots, cut where an
// expert's routed slots end. Uniform across the block (every thread reads
// the same index entries), so segment may synchronize.
template <typename T, typename Segment>
__device__ __forceinline__ void for_each_segment(const EsmmArgs<T>& p, int64_t first, int64_t last,
                                                 Segment&& segment) {
  for (int64_t begin = first; begin < last;) {
    const int64_t e = expert_of_slot(p.expert_starts, p.num_experts, begin);
    const int64_t end = min(last, p.expert_starts[e] + p.counts[e]);
    if (begin < end) segment(e, begin, end);
    begin = max(p.expert_starts[e + 1], begin + 1);  // past e's padding
  }
}

// Fills tile_choices[0 .. rows) with the choices at slots first + r that are
// in [begin, end), -1 elsewhere; synchronizes before and after.
template <int kRows>
__device__ __forceinline__ void load_tile_choices(const int64_t* slots, int64_t choices, int64_t first, int64_t begin,
                                                  int64_t end, int64_t* tile_choices) {
  __syncthreads();  // the previous segment is done with tile_choices (and the tiles)
  for (int r = threadIdx.x; r < kRows; r += blockDim.x) {
    const int64_t s = first + r;
    tile_choices[r] = s >= begin && s < end ? slot_choice(slots, s, choices) : -1;
  }
  __syncthreads();
}

// CUDA cores: a 64 x 64 output tile per block, 16-wide K steps, 256 threads
// as 16 x 16, each with a 4 x 4 micro-tile (rows ty*4.., columns tx*4..).
// The next K step is loaded into registers while this one is computed.
constexpr int kTileM = 64, kTileN = 64, kTileK = 16, kMicro = 4;
static_assert(kTileM * kTileK == kThreads * kMicro && kTileN * kTileK == kThreads * kMicro,
              "each thread loads four elements of each tile");
static_assert((kTileM / kMicro) * (kTileN / kMicro) == kThreads, "one micro-tile per thread");

template <typename T, typename Out, bool kWeightKN>
__global__ void __launch_bounds__(kThreads) esmm_kernel(const EsmmArgs<T> p, Out* __restrict__ y) {
  using Acc = typename Num<T>::Acc;
  __shared__ __align__(32) Acc x_tile[kTileK][kTileM];  // [k][slot]
  __shared__ __align__(32) Acc w_tile[kTileK][kTileN];  // [k][n]
  __shared__ int64_t tile_choices[kTileM];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  // Loaders: x as 64 rows x (4 threads x 4 consecutive k); w (N, K) the same
  // over n, w (K, N) as 16 k x (16 threads x 4 consecutive n).
  const int x_row = tid / 4, x_col = tid % 4 * kMicro;
  const int w_row = kWeightKN ? tid / 16 : tid / 4;
  const int w_col = kWeightKN ? tid % 16 * kMicro : tid % 4 * kMicro;
  const int64_t K = p.k, N = p.n;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t last = min(first + kTileM, p.num_slots);

  for (int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTileN; n0 < N;
       n0 += static_cast<int64_t>(gridDim.y) * kTileN) {
    for_each_segment(p, first, last, [&](int64_t e, int64_t begin, int64_t end) {
      load_tile_choices<kTileM>(p.slots, p.choices, first, begin, end, tile_choices);
      const int64_t xc = tile_choices[x_row];
      const T* x_src = xc >= 0 ? p.x + es_row(p.x_rows, xc, p.top_k) * K : nullptr;
      const T* w_e = p.w + e * N * K;
      // (N, K): this thread's weight row n0 + w_row, or none past N.
      const T* w_nk = !kWeightKN && n0 + w_row < N ? w_e + (n0 + w_row) * K : nullptr;

      Acc x_next[kMicro], w_next[kMicro];
      auto load = [&](int64_t k0) {
#pragma unroll
        for (int q = 0; q < kMicro; ++q) {
          const int64_t kk = k0 + x_col + q;
          x_next[q] = x_src != nullptr && kk < K ? Num<T>::load(x_src[kk]) : Acc(0);
        }
        if constexpr (kWeightKN) {
          const int64_t kk = k0 + w_row;
#pragma unroll
          for (int q = 0; q < kMicro; ++q) {
            const int64_t n = n0 + w_col + q;
            w_next[q] = kk < K && n < N ? Num<T>::load(w_e[kk * N + n]) : Acc(0);
          }
        } else {
#pragma unroll
          for (int q = 0; q < kMicro; ++q) {
            const int64_t kk = k0 + w_col + q;
            w_next[q] = w_nk != nullptr && kk < K ? Num<T>::load(w_nk[kk]) : Acc(0);
          }
        }
      };

      Acc acc[kMicro][kMicro];
#pragma unroll
      for (int i = 0; i < kMicro; ++i)
#pragma unroll
        for (int j = 0; j < kMicro; ++j) acc[i][j] = Acc(0);

      load(0);
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
#pragma unroll
        for (int q = 0; q < kMicro; ++q) {
          x_tile[x_col + q][x_row] = x_next[q];
          if constexpr (kWeightKN)
            w_tile[w_row][w_col + q] = w_next[q];
          else
            w_tile[w_col + q][w_row] = w_next[q];
        }
        __syncthreads();
        if (k0 + kTileK < K) load(k0 + kTileK);  // in flight during the products below
#pragma unroll
        for (int kk = 0; kk < kTileK; ++kk) {
          const Quad<Acc> a = load_quad(&x_tile[kk][ty * kMicro]);
          const Quad<Acc> b = load_quad(&w_tile[kk][tx * kMicro]);
#pragma unroll
          for (int i = 0; i < kMicro; ++i)
#pragma unroll
            for (int j = 0; j < kMicro; ++j) acc[i][j] += a.v[i] * b.v[j];
        }
        __syncthreads();  // before the next step overwrites the tiles
      }

#pragma unroll
      for (int i = 0; i < kMicro; ++i) {
        const int64_t c = tile_choices[ty * kMicro + i];
        if (c < 0) continue;
        const Acc gate = load_gate<T>(p.gates, p.gate_is_data, c);
        Out* dst = y + c * N;
#pragma unroll
        for (int j = 0; j < kMicro; ++j) {
          const int64_t n = n0 + tx * kMicro + j;
          if (n >= N) continue;
          Acc value = acc[i][j];
          if (p.bias != nullptr) value += Num<T>::load(p.bias[e * N + n]);
          dst[n] = to_out<T, Out>(mul_rn(gate, value));
        }
      }
    });
  }
}

// Tensor cores (float16 / bfloat16, sm_80+): a 64 x 128 output tile per
// block, 32-wide K steps, 8 warps as 2 (M) x 4 (N), each with 2 x 2 WMMA
// fragments of 16 x 16 in float32. The tiles keep the storage bits (padded
// rows: 80 or 272 bytes, multiples of the 32 bytes WMMA needs, and off the
// bank period); the accumulators go through shared memory (aliasing the
// tiles) so that the epilogue writes whole rows of 128 columns.
constexpr int kTcM = 64, kTcN = 128, kTcK = 32, kTcPad = 8, kTcWarpM = 32, kTcWarpN = 32;
[[maybe_unused]] constexpr int kFrag = 16;  // WMMA m = n = k (unused in builds for older GPUs only)
constexpr int kChunk = 8;  // elements per 16-byte load
static_assert(kTcM * kTcK == kThreads * kChunk && kTcN * kTcK == 2 * kThreads * kChunk,
              "each thread loads one chunk of x and two of w per step");
static_assert((kTcM / kTcWarpM) * (kTcN / kTcWarpN) * 32 == kThreads, "one warp tile per warp");

template <typename T>
struct WmmaType;
template <>
struct WmmaType<half_t> {
  using type = __half;
};
template <>
struct WmmaType<bfloat16_t> {
  using type = __nv_bfloat16;
};

struct alignas(16) Chunk {
  uint16_t v[kChunk];
};

// Elements [i, i + 8) of a row of `size` (zeros past it, or for no row):
// one 16-byte load when `vector` (row and size 16-byte aligned) and in range.
template <typename T>
__device__ __forceinline__ Chunk load_chunk(const T* row, int64_t i, int64_t size, bool vector) {
  Chunk chunk;
  if (row != nullptr && vector && i + kChunk <= size) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + i);
    memcpy(&chunk, &raw, sizeof raw);
    return chunk;
  }
#pragma unroll
  for (int q = 0; q < kChunk; ++q) chunk.v[q] = row != nullptr && i + q < size ? row[i + q].bits : uint16_t{0};
  return chunk;
}

[[maybe_unused]] __device__ __forceinline__ void store_chunk(uint16_t* dst, const Chunk& chunk) {
  *reinterpret_cast<Chunk*>(dst) = chunk;
}

template <bool kWeightKN>
struct TcShape {
  static constexpr int kXStride = kTcK + kTcPad;                           // x tile [slot][k]
  static constexpr int kWRows = kWeightKN ? kTcK : kTcN;                   // w tile [k][n] or [n][k]
  static constexpr int kWStride = kWeightKN ? kTcN + kTcPad : kTcK + kTcPad;
  static constexpr int kCStride = kTcN + 4;                                // accumulators [slot][n]
  struct Tiles {
    uint16_t x[kTcM * kXStride];
    uint16_t w[kWRows * kWStride];
  };
  union Shared {
    Tiles tiles;
    float c[kTcM * kCStride];
  };
};

template <typename T, typename Out, bool kWeightKN>
__global__ void __launch_bounds__(kThreads)
    esmm_tc_kernel(const EsmmArgs<T> p, Out* __restrict__ y, bool x_vector, bool w_vector) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using Shape = TcShape<kWeightKN>;
  using Element = typename WmmaType<T>::type;
  using WLayout = std::conditional_t<kWeightKN, wmma::row_major, wmma::col_major>;
  __shared__ __align__(128) typename Shape::Shared shared;
  __shared__ int64_t tile_choices[kTcM];
  const int tid = threadIdx.x, warp = tid / 32;
  const int warp_m = warp / (kTcN / kTcWarpN) * kTcWarpM, warp_n = warp % (kTcN / kTcWarpN) * kTcWarpN;
  // Loaders: x as 64 rows x (4 threads x 8 k); w (N, K) as 128 rows of n
  // (two per thread) x 8 k; w (K, N) as 32 rows of k (two per thread) x 8 n.
  const int x_row = tid / 4, x_col = tid % 4 * kChunk;
  const int w_row = kWeightKN ? tid / 16 : tid / 4;
  const int w_col = kWeightKN ? tid % 16 * kChunk : tid % 4 * kChunk;
  constexpr int kWRowStep = kWeightKN ? kTcK / 2 : kTcN / 2;
  const int64_t K = p.k, N = p.n;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTcM;
  const int64_t last = min(first + kTcM, p.num_slots);

  for (int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTcN; n0 < N; n0 += static_cast<int64_t>(gridDim.y) * kTcN) {
    for_each_segment(p, first, last, [&](int64_t e, int64_t begin, int64_t end) {
      load_tile_choices<kTcM>(p.slots, p.choices, first, begin, end, tile_choices);
      const int64_t xc = tile_choices[x_row];
      const T* x_src = xc >= 0 ? p.x + es_row(p.x_rows, xc, p.top_k) * K : nullptr;
      const T* w_e = p.w + e * N * K;

      Chunk x_next, w_next[2];
      auto load = [&](int64_t k0) {
        x_next = load_chunk(x_src, k0 + x_col, K, x_vector);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = w_row + h * kWRowStep;
          if constexpr (kWeightKN) {
            const T* src = k0 + row < K ? w_e + (k0 + row) * N : nullptr;
            w_next[h] = load_chunk(src, n0 + w_col, N, w_vector);
          } else {
            const T* src = n0 + row < N ? w_e + (n0 + row) * K : nullptr;
            w_next[h] = load_chunk(src, k0 + w_col, K, w_vector);
          }
        }
      };

      wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

      load(0);
      for (int64_t k0 = 0; k0 < K; k0 += kTcK) {
        store_chunk(&shared.tiles.x[x_row * Shape::kXStride + x_col], x_next);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          store_chunk(&shared.tiles.w[(w_row + h * kWRowStep) * Shape::kWStride + w_col], w_next[h]);
        __syncthreads();
        if (k0 + kTcK < K) load(k0 + kTcK);  // in flight during the products below
#pragma unroll
        for (int kk = 0; kk < kTcK; kk += kFrag) {
          wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, Element, wmma::row_major> a[2];
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, Element, WLayout> b[2];
#pragma unroll
          for (int i = 0; i < 2; ++i)
            wmma::load_matrix_sync(
                a[i], reinterpret_cast<const Element*>(&shared.tiles.x[(warp_m + i * kFrag) * Shape::kXStride + kk]),
                Shape::kXStride);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int n = warp_n + j * kFrag;
            const uint16_t* base = kWeightKN ? &shared.tiles.w[kk * Shape::kWStride + n]
                                             : &shared.tiles.w[n * Shape::kWStride + kk];
            wmma::load_matrix_sync(b[j], reinterpret_cast<const Element*>(base), Shape::kWStride);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();  // before the next step (or the accumulators) overwrite the tiles
      }

#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          wmma::store_matrix_sync(&shared.c[(warp_m + i * kFrag) * Shape::kCStride + warp_n + j * kFrag], acc[i][j],
                                  Shape::kCStride, wmma::mem_row_major);
      __syncthreads();
      for (int i = tid; i < kTcM * kTcN; i += kThreads) {
        const int r = i / kTcN, col = i % kTcN;
        const int64_t c = tile_choices[r], n = n0 + col;
        if (c < 0 || n >= N) continue;
        float value = shared.c[r * Shape::kCStride + col];
        if (p.bias != nullptr) value += Num<T>::load(p.bias[e * N + n]);
        y[c * N + n] = to_out<T, Out>(mul_rn(load_gate<T>(p.gates, p.gate_is_data, c), value));
      }
      // The next segment's load_tile_choices synchronizes before the tiles are reused.
    });
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // never launched: the host checks tensor_cores_built first
#endif
}

// y[t] = sum over j in order of the per-choice results ws[t * k + j] (zero
// rows for choices not routed).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_choices_kernel(const typename Num<T>::Acc* __restrict__ ws, int64_t num_tokens, int64_t top_k, int64_t N,
                       T* __restrict__ y) {
  using Acc = typename Num<T>::Acc;
  for (int64_t i = global_thread(); i < num_tokens * N; i += thread_count()) {
    const int64_t t = i / N, n = i - t * N;
    const Acc* src = ws + t * top_k * N + n;
    Acc acc = Acc(0);
    for (int64_t j = 0; j < top_k; ++j) acc += src[j * N];
    y[i] = Num<T>::store(acc);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the code of `kernel` that runs on the current device has the
// tensor-core body: it was compiled for sm_80 or newer. A build for older
// GPUs only (A2A_CUDA_ARCHS) runs its PTX, without that body, even on an
// sm_80+ device, and then takes the CUDA-core kernel.
template <typename Kernel>
bool tensor_cores_built(Kernel* kernel) {
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
  return attributes.ptxVersion >= 80;
}

template <typename T, typename Out>
void launch_esmm(const EsLaunch& launch, const EsmmArgs<T>& args, a2a_es_weight_layout_t w_layout, Out* out) {
  const bool kn = w_layout == A2A_ES_WEIGHT_KN;
  constexpr bool kSixteenBit = std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>;
  if constexpr (kSixteenBit) {
    if (tensor_cores_built(kn ? esmm_tc_kernel<T, Out, true> : esmm_tc_kernel<T, Out, false>)) {
      const dim3 grid(static_cast<unsigned>(ceil_div(args.num_slots, kTcM)), grid_yz(ceil_div(args.n, kTcN)));
      // 16-byte loads need 16-byte rows: x rows of K, w rows of K (N, K) or N (K, N).
      const bool x_vector = aligned16(args.x) && args.k % kChunk == 0;
      const bool w_vector = aligned16(args.w) && (kn ? args.n : args.k) % kChunk == 0;
      if (kn)
        esmm_tc_kernel<T, Out, true><<<grid, kThreads, 0, launch.stream>>>(args, out, x_vector, w_vector);
      else
        esmm_tc_kernel<T, Out, false><<<grid, kThreads, 0, launch.stream>>>(args, out, x_vector, w_vector);
      check_launch("esmm_tc_kernel");
      return;
    }
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(args.num_slots, kTileM)), grid_yz(ceil_div(args.n, kTileN)));
  if (kn)
    esmm_kernel<T, Out, true><<<grid, kThreads, 0, launch.stream>>>(args, out);
  else
    esmm_kernel<T, Out, false><<<grid, kThreads, 0, launch.stream>>>(args, out);
  check_launch("esmm_kernel");
}

// ---------------------------------------------------------------------------
// ESS: out[e][n] = sum over e's slots in order of gate * x[row][n].

constexpr int kEssThreads = 128;  // columns per block, and slots staged per round

template <typename T>
__global__ void __launch_bounds__(kEssThreads)
    ess_kernel(const int64_t* __restrict__ slots, const int64_t* __restrict__ expert_starts,
               const int64_t* __restrict__ counts, int64_t num_experts, int64_t top_k, int64_t choices,
               const T* __restrict__ x, a2a_es_rows_t x_rows, int64_t N, const void* __restrict__ gates,
               bool gate_is_data, T* __restrict__ out) {
  using Acc = typename Num<T>::Acc;
  __shared__ int64_t rows[kEssThreads];
  __shared__ Acc row_gates[kEssThreads];
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kEssThreads + threadIdx.x;
  for (int64_t e = blockIdx.y; e < num_experts; e += gridDim.y) {  // uniform across the block
    const int64_t begin = expert_starts[e], count = counts[e];
    const int64_t limit = min(count, expert_starts[e + 1] - begin);  // never past the sub-vector
    Acc acc = Acc(0);
    for (int64_t first = 0; first < limit; first += kEssThreads) {
      __syncthreads();  // the previous round is done with rows / row_gates
      if (first + threadIdx.x < limit) {
        const int64_t c = slot_choice(slots, begin + first + threadIdx.x, choices);
        rows[threadIdx.x] = c >= 0 ? es_row(x_rows, c, top_k) : -1;
        row_gates[threadIdx.x] = c >= 0 ? load_gate<T>(gates, gate_is_data, c) : Acc(0);
      }
      __syncthreads();
      const int m = static_cast<int>(min(static_cast<int64_t>(kEssThreads), limit - first));
      if (n < N) {
#pragma unroll 8
        for (int i = 0; i < m; ++i) {
          const int64_t row = rows[i];
          if (row >= 0) acc += mul_rn(row_gates[i], Num<T>::load(x[row * N + n]));
        }
      }
    }
    if (n < N) out[e * N + n] = Num<T>::store(acc);
  }
}

// ---------------------------------------------------------------------------
// ESTMM: out[e] (A, B) = sum over e's slots in order of gate * a[row_a]^T b[row_b].
// A 64 x 64 tile of out[e] per block, 256 threads with 4 x 4 micro-tiles as
// in esmm_kernel; the slots are the contraction, 16 per step, the gate folded
// into the staged a values.

template <typename T>
struct EstmmArgs {
  const int64_t* slots;
  const int64_t* expert_starts;
  const int64_t* counts;
  int64_t num_experts;
  int64_t top_k;
  int64_t choices;
  const T* a;
  a2a_es_rows_t a_rows;
  int64_t a_dim;  // A
  const T* b;
  a2a_es_rows_t b_rows;
  int64_t b_dim;  // B
  const void* gates;
  bool gate_is_data;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) estmm_kernel(const EstmmArgs<T> p, T* __restrict__ out) {
  using Acc = typename Num<T>::Acc;
  __shared__ __align__(32) Acc a_tile[kTileK][kTileM];  // [slot][i]: gate * a
  __shared__ __align__(32) Acc b_tile[kTileK][kTileN];  // [slot][j]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int load_slot = tid / 16, load_col = tid % 16 * kMicro;  // 16 slots x (16 threads x 4 columns)
  const int64_t A = p.a_dim, B = p.b_dim;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTileM;

  for (int64_t e = blockIdx.z; e < p.num_experts; e += gridDim.z) {
    for (int64_t j0 = static_cast<int64_t>(blockIdx.y) * kTileN; j0 < B; j0 += static_cast<int64_t>(gridDim.y) * kTileN) {
      const int64_t begin = p.expert_starts[e];
      const int64_t count = min(p.counts[e], p.expert_starts[e + 1] - begin);  // never past the sub-vector

      Acc a_next[kMicro], b_next[kMicro];
      auto load = [&](int64_t s0) {
        const int64_t s = s0 + load_slot;
        const int64_t c = s < count ? slot_choice(p.slots, begin + s, p.choices) : -1;
        const T* a_src = c >= 0 ? p.a + es_row(p.a_rows, c, p.top_k) * A : nullptr;
        const T* b_src = c >= 0 ? p.b + es_row(p.b_rows, c, p.top_k) * B : nullptr;
        const Acc gate = c >= 0 ? load_gate<T>(p.gates, p.gate_is_data, c) : Acc(0);
#pragma unroll
        for (int q = 0; q < kMicro; ++q) {
          const int64_t i = i0 + load_col + q, j = j0 + load_col + q;
          a_next[q] = a_src != nullptr && i < A ? mul_rn(gate, Num<T>::load(a_src[i])) : Acc(0);
          b_next[q] = b_src != nullptr && j < B ? Num<T>::load(b_src[j]) : Acc(0);
        }
      };

      Acc acc[kMicro][kMicro];
#pragma unroll
      for (int i = 0; i < kMicro; ++i)
#pragma unroll
        for (int j = 0; j < kMicro; ++j) acc[i][j] = Acc(0);

      load(0);
      for (int64_t s0 = 0; s0 < count; s0 += kTileK) {
#pragma unroll
        for (int q = 0; q < kMicro; ++q) {
          a_tile[load_slot][load_col + q] = a_next[q];
          b_tile[load_slot][load_col + q] = b_next[q];
        }
        __syncthreads();
        if (s0 + kTileK < count) load(s0 + kTileK);  // in flight during the products below
#pragma unroll
        for (int kk = 0; kk < kTileK; ++kk) {  // slots in order; the ones past count are zeros
          const Quad<Acc> av = load_quad(&a_tile[kk][ty * kMicro]);
          const Quad<Acc> bv = load_quad(&b_tile[kk][tx * kMicro]);
#pragma unroll
          for (int i = 0; i < kMicro; ++i)
#pragma unroll
            for (int j = 0; j < kMicro; ++j) acc[i][j] += av.v[i] * bv.v[j];
        }
        __syncthreads();  // before the next step overwrites the tiles
      }

#pragma unroll
      for (int i = 0; i < kMicro; ++i) {
        const int64_t row = i0 + ty * kMicro + i;
        if (row >= A) continue;
        T* dst = out + (e * A + row) * B;
#pragma unroll
        for (int j = 0; j < kMicro; ++j) {
          const int64_t col = j0 + tx * kMicro + j;
          if (col < B) dst[col] = Num<T>::store(acc[i][j]);
        }
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Host side

void cuda_es_scatter_slots(const EsLaunch& launch, const RouteProblem& problem, const int64_t* locations,
                           const int64_t* expert_starts, int64_t num_slots, int64_t* slots) {
  if (num_slots <= 0) return;
  // All ones is -1 in every int64.
  check_cuda(cudaMemsetAsync(slots, 0xff, static_cast<size_t>(num_slots) * sizeof(int64_t), launch.stream),
             "cudaMemsetAsync");
  const int64_t choices = problem.num_tokens * problem.top_k;
  if (choices == 0) return;
  scatter_slots_kernel<<<grid_for(choices, kThreads, launch.max_blocks), kThreads, 0, launch.stream>>>(
      problem.indices, problem.index_dtype, choices, problem.num_experts, locations, expert_starts, slots);
  check_launch("scatter_slots_kernel");
}

void cuda_esmm(const EsLaunch& launch, const a2a_es_index_t& index, const EsMatmul& problem) {
  with_float_type("esmm", problem.dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Num<T>::Acc;
    const int64_t choices = index.num_tokens * index.top_k, N = problem.n;
    const bool by_choice = problem.y_rows == A2A_ES_ROWS_CHOICE;
    const int64_t y_rows = by_choice ? choices : index.num_tokens;
    if (y_rows == 0 || N == 0) return;  // y is empty
    // Results land at row c: of y (by choice; by token with k == 1, where
    // c == t), else of the workspace, whose rows the second kernel adds.
    const bool through_workspace = !by_choice && index.top_k > 1;
    // Rows of choices (tokens) that are not routed stay zero.
    if (through_workspace)
      check_cuda(cudaMemsetAsync(problem.workspace, 0, static_cast<size_t>(choices * N) * sizeof(Acc), launch.stream),
                 "cudaMemsetAsync");
    else
      check_cuda(cudaMemsetAsync(problem.y, 0, static_cast<size_t>(y_rows * N) * sizeof(T), launch.stream),
                 "cudaMemsetAsync");
    if (index.num_slots > 0 && index.num_experts > 0) {
      const EsmmArgs<T> args{index.slots,
                             index.expert_starts,
                             index.counts,
                             index.num_slots,
                             index.num_experts,
                             index.top_k,
                             choices,
                             static_cast<const T*>(problem.x.data),
                             problem.x.rows,
                             problem.x.dim,
                             static_cast<const T*>(problem.w),
                             static_cast<const T*>(problem.bias),
                             problem.gates.data,
                             problem.gates.is_data,
                             N};
      if (through_workspace)
        launch_esmm<T, Acc>(launch, args, problem.w_layout, static_cast<Acc*>(problem.workspace));
      else
        launch_esmm<T, T>(launch, args, problem.w_layout, static_cast<T*>(problem.y));
    }
    if (through_workspace) {
      sum_choices_kernel<T><<<grid_for(index.num_tokens * N, kThreads, launch.max_blocks), kThreads, 0,
                              launch.stream>>>(static_cast<const Acc*>(problem.workspace), index.num_tokens,
                                               index.top_k, N, static_cast<T*>(problem.y));
      check_launch("sum_choices_kernel");
    }
  });
}

void cuda_ess(const EsLaunch& launch, const a2a_es_index_t& index, const EsOperand& x, const EsGates& gates,
              a2a_dtype_t dtype, void* out) {
  with_float_type("ess", dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t E = index.num_experts, N = x.dim;
    if (E == 0 || N == 0) return;
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kEssThreads)), grid_yz(E));
    ess_kernel<T><<<grid, kEssThreads, 0, launch.stream>>>(
        index.slots, index.expert_starts, index.counts, E, index.top_k, index.num_tokens * index.top_k,
        static_cast<const T*>(x.data), x.rows, N, gates.data, gates.is_data, static_cast<T*>(out));
    check_launch("ess_kernel");
  });
}

void cuda_estmm(const EsLaunch& launch, const a2a_es_index_t& index, const EsOperand& a, const EsOperand& b,
                const EsGates& gates, a2a_dtype_t dtype, void* out) {
  with_float_type("estmm", dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t E = index.num_experts, A = a.dim, B = b.dim;
    if (E == 0 || A == 0 || B == 0) return;
    const EstmmArgs<T> args{index.slots,
                            index.expert_starts,
                            index.counts,
                            E,
                            index.top_k,
                            index.num_tokens * index.top_k,
                            static_cast<const T*>(a.data),
                            a.rows,
                            A,
                            static_cast<const T*>(b.data),
                            b.rows,
                            B,
                            gates.data,
                            gates.is_data};
    const dim3 grid(static_cast<unsigned>(ceil_div(A, kTileM)), grid_yz(ceil_div(B, kTileN)), grid_yz(E));
    estmm_kernel<T><<<grid, kThreads, 0, launch.stream>>>(args, static_cast<T*>(out));
    check_launch("estmm_kernel");
  });
}

}  // namespace a2a::moe
