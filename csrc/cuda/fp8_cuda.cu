// CUDA kernels of the FP8 row quantization, with the element logic of
// moe/fp8.hpp (the CPU backend's, so both give the same bits).
//
// quantize: one warp per (row, block) pair, grid-striding over the pairs. Each
// lane folds the amax of the block's elements lane, lane + 32, ...; a
// butterfly of __shfl_xor_sync gives every lane the block's amax (a maximum
// is exact in any order, so it equals the CPU's sequential one), then each
// lane encodes its elements and lane 0 stores the scale.
// dequantize: one thread per element, grid-striding, decode(q) * scale
// rounded once to the output dtype.
#include "cuda/fp8_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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
    float amax = 0.0f;
    for (int64_t i = lane; i < n; i += kWarp) amax = fold_amax(amax, static_cast<float>(Num<T>::load(src[i])));
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(kFullMask, amax, offset);
      amax = other > amax ? other : amax;
    }
    const BlockScale s = block_scale(amax, max_value);
    uint8_t* dst = static_cast<uint8_t*>(r.q) + row * r.q_stride + begin;
    for (int64_t i = lane; i < n; i += kWarp)
      dst[i] = Format::encode(__fmul_rn(static_cast<float>(Num<T>::load(src[i])), s.multiplier));
    if (lane == 0) r.scales[row * r.scale_stride + b] = s.scale;
  }
}

template <typename T, typename Format>
__global__ void __launch_bounds__(kThreads) dequantize_fp8_kernel(const a2a_fp8_rows_t r, T* __restrict__ y) {
  using Acc = typename Num<T>::Acc;
  const int64_t elements = r.rows * r.cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements; i += stride) {
    const int64_t row = i / r.cols;
    const int64_t col = i - row * r.cols;
    const uint8_t code = static_cast<const uint8_t*>(r.q)[row * r.q_stride + col];
    const float scale = r.scales[row * r.scale_stride + col / r.block];
    y[i] = Num<T>::store(static_cast<Acc>(__fmul_rn(Format::decode(code), scale)));
  }
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
    dequantize_fp8_kernel<T, decltype(format)><<<grid_for(rows.rows * rows.cols, kThreads, launch.max_blocks),
                                                 kThreads, 0, launch.stream>>>(rows, static_cast<T*>(y));
    check_launch("dequantize_fp8_kernel");
  });
}

}  // namespace a2a::moe
