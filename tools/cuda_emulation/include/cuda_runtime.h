// Host emulation of the CUDA execution model, enough to run es_cuda.cu's
// kernels on the CPU: one block at a time, one std::thread per CUDA thread,
// __shared__ as static storage, __syncthreads as a barrier that reports a
// deadlock (non-uniform barriers) instead of hanging.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace emu {
// The PTX version every kernel reports (es_cuda.cu takes the tensor-core
// ESMM from 80 up): the check program sets it per case.
inline int ptx_version = 80;
}  // namespace emu
struct cudaFuncAttributes {
  int ptxVersion = 0;
  int binaryVersion = 0;
};
template <class Function>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Function*) {
  attributes->ptxVersion = attributes->binaryVersion = emu::ptx_version;
  return cudaSuccess;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }

template <class A, class B>
inline auto min(A a, B b) -> decltype(a < b ? a : b) { return a < b ? a : b; }
template <class A, class B>
inline auto max(A a, B b) -> decltype(a < b ? a : b) { return a < b ? b : a; }

namespace emu {
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  unsigned count = 0, waiting = 0, generation = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    const unsigned gen = generation;
    if (++waiting == count) {
      waiting = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return generation != gen; })) {
      std::fprintf(stderr, "emu: __syncthreads deadlock in block (%u,%u,%u): %u of %u threads waiting\n", blockIdx.x,
                   blockIdx.y, blockIdx.z, waiting, count);
      std::abort();
    }
  }
};
inline Barrier barrier;
inline long long launches = 0, blocks_run = 0;

inline void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x * block.y * block.z == 0) {
    std::fprintf(stderr, "emu: launch with an empty grid or block\n");
    std::abort();
  }
  if (grid.y > 65535 || grid.z > 65535) {
    std::fprintf(stderr, "emu: grid y/z above 65535\n");
    std::abort();
  }
  ++launches;
  gridDim = grid;
  blockDim = block;
  const unsigned threads = block.x * block.y * block.z;
  barrier.count = threads;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        ++blocks_run;
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (unsigned t = 0; t < threads; ++t)
          pool.emplace_back([&, t, bx, by, bz] {
            blockIdx = dim3(bx, by, bz);
            threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
            body();
          });
        for (auto& th : pool) th.join();
      }
}
}  // namespace emu

inline void __syncthreads() { emu::barrier.wait(); }
