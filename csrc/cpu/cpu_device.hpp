// Host memory; layout copies are memcpy over chunks, spread over the CPU
// thread pool (cpu/thread_pool.hpp) when they are large.
#pragma once

#include "core/device.hpp"

namespace a2a {

class CpuDevice final : public Device {
 public:
  // num_threads: the most threads one copy uses; 0 = the pool's default
  // (A2A_NUM_THREADS, else every core).
  explicit CpuDevice(int num_threads = 0) : num_threads_(num_threads) {}
  const char* name() const override { return "cpu"; }

 protected:
  void copy_impl(void* dst, const void* src, size_t bytes) override;
  void transpose_chunks_impl(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) override;
  void copy_ranges_impl(void* dst, const void* src, const CopyRange* ranges, size_t count) override;

 private:
  int num_threads_;
};

}  // namespace a2a
