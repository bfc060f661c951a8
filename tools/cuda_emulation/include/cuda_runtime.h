// Host emulation of the CUDA runtime and device functions that csrc/cuda's
// kernel files use, on the scheduler of emu.hpp (run.py explains the whole).
// Only what those files use is here: anything else fails to compile, which
// is the signal to emulate it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu.hpp"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

// Per fiber: the thread and block index of the CUDA thread running now.
#define threadIdx (::emu::runtime.thread_index())
#define blockIdx (::emu::runtime.block_index())

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

// ---------------------------------------------------------------------------
// Runtime API (the stream is ignored: everything runs at once, in order)

// The toolkit the project builds with (nvcc 13): kernel parameters up to 32764 bytes.
#define CUDART_VERSION 13000

typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemoryType { cudaMemoryTypeUnregistered, cudaMemoryTypeHost, cudaMemoryTypeDevice, cudaMemoryTypeManaged };
struct cudaPointerAttributes {
  cudaMemoryType type = cudaMemoryTypeUnregistered;
  int device = 0;
};

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(dst, src, n);
  return cudaSuccess;
}
// Host buffers of the check programs are pageable memory that CUDA does not know.
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes*, const void*) { return cudaErrorInvalidValue; }
inline cudaError_t cudaGetDevice(int* device) {
  *device = emu::device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (attribute != cudaDevAttrMultiProcessorCount || device < 0 || device >= 64) return cudaErrorInvalidValue;
  *value = emu::device_sms[device];
  return cudaSuccess;
}

struct cudaFuncAttributes {
  int ptxVersion = 0;
  int binaryVersion = 0;
};
template <class Function>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Function*) {
  attributes->ptxVersion = attributes->binaryVersion = emu::ptx_version;
  return cudaSuccess;
}

// ---------------------------------------------------------------------------
// Device functions

// A product rounded on its own: the empty asm keeps the compiler, which
// contracts a * b + c into an FMA in the kernel file (as nvcc does), from
// fusing it with a sum, as nvcc never fuses __fmul_rn.
inline float __fmul_rn(float a, float b) {
  float product = a * b;
  asm("" : "+x"(product));
  return product;
}
inline double __dmul_rn(double a, double b) {
  double product = a * b;
  asm("" : "+x"(product));
  return product;
}
inline unsigned __float_as_uint(float f) { return __builtin_bit_cast(unsigned, f); }
inline float __uint_as_float(unsigned u) { return __builtin_bit_cast(float, u); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
[[noreturn]] inline void __trap() { emu::fatal("__trap() in block (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z); }

// By value: decltype(a < b ? a : b) would be a reference to a parameter.
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

// A plain store of one 16-byte vector (UBSan checks its alignment).
inline void __stwb(uint4* p, uint4 value) { *p = value; }

// Atomics are relaxed, as CUDA's: ThreadSanitizer sees them as atomic
// accesses that order nothing.
template <class T>
inline T atomicAdd(T* p, T value) { return __atomic_fetch_add(p, value, __ATOMIC_RELAXED); }
template <class T>
inline T atomicCAS(T* p, T compare, T value) {
  __atomic_compare_exchange_n(p, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
template <class T>
inline T atomicMin(T* p, T value) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (value < old && !__atomic_compare_exchange_n(p, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

inline void __syncthreads() { emu::runtime.syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::runtime.warp_collective(emu::kSyncwarp, mask, 0); }

template <class T>
inline unsigned __match_any_sync(unsigned mask, T value) {
  static_assert(sizeof(T) <= 8, "a 32- or 64-bit value");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof value);
  const emu::Cell<uint64_t>* all = emu::runtime.warp_collective(emu::kMatch, mask, bits);
  unsigned same = 0;
  for (unsigned l = 0; l < emu::kWarp; ++l) same |= (all[l].get() == bits ? 1u : 0u) << l;
  return same;
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const emu::Cell<uint64_t>* all = emu::runtime.warp_collective(emu::kBallot, mask, predicate != 0);
  unsigned bits = 0;
  for (unsigned l = 0; l < emu::kWarp; ++l) bits |= (all[l].get() != 0 ? 1u : 0u) << l;
  return bits;
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8, "a 32- or 64-bit value");
  if (width != 32) emu::fatal("__shfl_xor_sync with width %d: only 32 is emulated", width);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof value);
  const emu::Cell<uint64_t>* all = emu::runtime.warp_collective(emu::kShuffle, mask, bits);
  const unsigned lane = emu::runtime.linear_thread() % emu::kWarp;
  const uint64_t other = all[lane ^ (static_cast<unsigned>(lane_mask) & 31)].get();
  T out;
  std::memcpy(&out, &other, sizeof out);
  return out;
}
