// CUDA kernels of the FP8 row quantization, with the element logic of
// moe/fp8.hpp (the CPU backend's, so both give the same bits).
//
// quantize: one warp per (row, block) pair, grid-striding over the pairs.
// The block is read in units of 4 elements (one 8- or 16-byte load a unit,
// where the unit's source is aligned so; the rest element by element): each
// lane folds the amax of its units, a butterfly of __shfl_xor_sync gives every
// lane the block's amax (a maximum is exact in any order, so it equals the
// CPU's sequential one), then each lane encodes its units (the first held in
// registers since the amax pass, any others read again) and stores 4 codes
// at a time; lane 0 stores the scale.
// dequantize: a group of `lanes` threads (a power of two up to a warp, sized
// to the row) per row, grid-striding over the rows. Where a row's codes and
// outputs start 16-byte aligned and the block is a multiple of 16 channels,
// a thread converts 16 codes at a time (one 16-byte load, one scale, 16
// outputs in 16-byte stores); every other element, and every row not so
// aligned, one by one: decode(q) * scale rounded once to the output dtype.
// (The first version took one thread per element, with a 64-bit division by
// the row length for every element, and byte-wide loads: 0.18-0.27 of a
// device memcpy on the H200.)
#include "cuda/fp8_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cuda/cuda_check.hpp"
#include "moe/elementwise.hpp"
#include "moe/fp8.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;

unsigned grid_for(int64_t items, int64_t per_block, int max_blocks) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks)));
}

// Four elements of T, loaded or stored as one (uint2) or two (uint4) 16-byte
// accesses; the address is aligned to kUnitAlign<T>.
constexpr int kUnit = 4;
template <typename T>
constexpr uintptr_t kUnitAlign = sizeof(T) * kUnit < 16 ? sizeof(T) * kUnit : 16;

template <typename T>
struct Unit {
  T v[kUnit];
};

template <typename T>
__device__ __forceinline__ Unit<T> load_unit(const T* src) {
  Unit<T> unit;
  if constexpr (sizeof(T) * kUnit == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    memcpy(&unit, &raw, sizeof raw);
  } else {
    static_assert(sizeof(T) * kUnit % 16 == 0, "a unit is 8 bytes or whole 16-byte vectors");
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(T) * kUnit / 16); ++w) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[w];
      memcpy(reinterpret_cast<char*>(&unit) + 16 * w, &raw, sizeof raw);
    }
  }
  return unit;
}

template <typename T>
__device__ __forceinline__ bool aligned_to(const T* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename T, typename Format>
__global__ void __launch_bounds__(kThreads)
    quantize_fp8_kernel(const T* __restrict__ x, const a2a_fp8_rows_t r, float max_value) {
  const int lane = threadIdx.x % kWarp;
  const int64_t blocks_per_row = fp8_blocks(r.cols, r.block);
  const int64_t pairs = r.rows * blocks_per_row;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t pair = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; pair < pairs;
       pair += warps) {
    const int64_t row = pair / blocks_per_row;
    const int64_t b = pair - row * blocks_per_row;
    const int64_t begin = b * r.block;
    const int64_t n = min(r.block, r.cols - begin);
    const T* src = x + row * r.cols + begin;
    uint8_t* dst = static_cast<uint8_t*>(r.q) + row * r.q_stride + begin;
    // Whole units where the source and the codes are aligned for them (uniform across the warp).
    const int64_t units = aligned_to(src, kUnitAlign<T>) && aligned_to(dst, kUnit) ? n / kUnit : 0;
    const bool holds = lane < units;
    Unit<T> held;  // the lane's first unit, kept for the encoding
    float amax = 0.0f;
    if (holds) {
      held = load_unit(src + lane * kUnit);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) amax = fold_amax(amax, static_cast<float>(Num<T>::load(held.v[e])));
    }
    for (int64_t u = lane + kWarp; u < units; u += kWarp) {
      const Unit<T> unit = load_unit(src + u * kUnit);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) amax = fold_amax(amax, static_cast<float>(Num<T>::load(unit.v[e])));
    }
    for (int64_t i = units * kUnit + lane; i < n; i += kWarp)
      amax = fold_amax(amax, static_cast<float>(Num<T>::load(src[i])));
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(kFullMask, amax, offset);
      amax = other > amax ? other : amax;
    }
    const BlockScale s = block_scale(amax, max_value);
    const auto encode_unit = [&](const Unit<T>& unit, int64_t u) {
      uint32_t codes = 0;
#pragma unroll
      for (int e = 0; e < kUnit; ++e)
        codes |= static_cast<uint32_t>(Format::encode(__fmul_rn(static_cast<float>(Num<T>::load(unit.v[e])),
                                                                s.multiplier)))
                 << (8 * e);
      *reinterpret_cast<uint32_t*>(dst + u * kUnit) = codes;  // little-endian: element e at byte e
    };
    if (holds) encode_unit(held, lane);
    for (int64_t u = lane + kWarp; u < units; u += kWarp) encode_unit(load_unit(src + u * kUnit), u);
    for (int64_t i = units * kUnit + lane; i < n; i += kWarp)
      dst[i] = Format::encode(__fmul_rn(static_cast<float>(Num<T>::load(src[i])), s.multiplier));
    if (lane == 0) r.scales[row * r.scale_stride + b] = s.scale;
  }
}

constexpr int kCodesPerVector = 16;

template <typename T, typename Format>
__device__ __forceinline__ T dequantized(uint8_t code, float scale) {
  return Num<T>::store(static_cast<typename Num<T>::Acc>(__fmul_rn(Format::decode(code), scale)));
}

template <typename T, typename Format>
__global__ void __launch_bounds__(kThreads) dequantize_fp8_kernel(const a2a_fp8_rows_t r, T* __restrict__ y,
                                                                  int lanes) {
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.x / lanes;
  const bool whole_blocks = r.block % kCodesPerVector == 0;  // a vector's codes share one scale
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / lanes; row < r.rows;
       row += groups) {
    const uint8_t* q = static_cast<const uint8_t*>(r.q) + row * r.q_stride;
    const float* scales = r.scales + row * r.scale_stride;
    T* out = y + row * r.cols;
    const int64_t vectors = whole_blocks && aligned_to(q, 16) && aligned_to(out, 16) ? r.cols / kCodesPerVector : 0;
    for (int64_t v = lane; v < vectors; v += lanes) {
      const int64_t col = v * kCodesPerVector;
      const uint4 raw = *reinterpret_cast<const uint4*>(q + col);
      uint8_t codes[kCodesPerVector];
      memcpy(codes, &raw, sizeof raw);
      const float scale = scales[col / r.block];
      T values[kCodesPerVector];
#pragma unroll
      for (int e = 0; e < kCodesPerVector; ++e) values[e] = dequantized<T, Format>(codes[e], scale);
#pragma unroll
      for (int w = 0; w < static_cast<int>(sizeof(T)); ++w) {  // 16 elements are sizeof(T) 16-byte vectors
        uint4 chunk;
        memcpy(&chunk, reinterpret_cast<const char*>(values) + 16 * w, sizeof chunk);
        reinterpret_cast<uint4*>(out + col)[w] = chunk;
      }
    }
    for (int64_t col = vectors * kCodesPerVector + lane; col < r.cols; col += lanes)
      out[col] = dequantized<T, Format>(q[col], scales[col / r.block]);
  }
}

// Threads per row of dequantize: one per 16 codes, a power of two up to a warp.
int dequantize_lanes(int64_t cols) {
  int lanes = 1;
  while (lanes < kWarp && lanes * static_cast<int64_t>(kCodesPerVector) < cols) lanes *= 2;
  return lanes;
}

}  // namespace

void cuda_quantize_fp8(const EsLaunch& launch, const void* x, a2a_dtype_t dtype, const a2a_fp8_rows_t& rows) {
  with_fp8_types("quantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    const int64_t pairs = rows.rows * fp8_blocks(rows.cols, rows.block);
    quantize_fp8_kernel<T, decltype(format)><<<grid_for(pairs, kThreads / kWarp, launch.max_blocks), kThreads, 0,
                                               launch.stream>>>(static_cast<const T*>(x), rows, fp8_max(rows.format));
    check_launch("quantize_fp8_kernel");
  });
}

void cuda_dequantize_fp8(const EsLaunch& launch, const a2a_fp8_rows_t& rows, a2a_dtype_t dtype, void* y) {
  with_fp8_types("dequantize_fp8", dtype, rows.format, [&](auto tag, auto format) {
    using T = decltype(tag);
    const int lanes = dequantize_lanes(rows.cols);
    dequantize_fp8_kernel<T, decltype(format)><<<grid_for(rows.rows, kThreads / lanes, launch.max_blocks), kThreads,
                                                 0, launch.stream>>>(rows, static_cast<T*>(y), lanes);
    check_launch("dequantize_fp8_kernel");
  });
}

}  // namespace a2a::moe
