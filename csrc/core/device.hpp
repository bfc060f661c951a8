// The device interface: where bytes live and how local layout copies run.
// CPU: plain memory and host copies. CUDA: kernels and copies enqueued on the
// caller's stream (set per call with set_stream), returning without waiting.
#pragma once

#include <cstddef>
#include <functional>

#include "core/counters.hpp"

namespace a2a {

struct CopyRange {
  size_t src_offset;
  size_t dst_offset;
  size_t bytes;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;
  // The stream later calls are enqueued on (a cudaStream_t; nullptr = the
  // legacy default stream). Ignored by the CPU.
  virtual void set_stream(void* /*stream*/) {}
  // True while the stream is being captured into a CUDA graph, where nothing
  // may wait for it.
  virtual bool capturing() const { return false; }
  // Where the operations below are counted besides the process's counters
  // (its communicator's).
  void attach_counters(Counters* counters) { counters_ = counters; }

  // Each of these counts itself (a kernel call, a host wait, an allocation)
  // and runs the backend's implementation (the *_impl below).
  void copy(void* dst, const void* src, size_t bytes) {
    count(counters_, Count::kKernelCalls);
    copy_impl(dst, src, bytes);
  }
  // Views src as a rows x cols grid of chunk_bytes chunks (row-major) and
  // writes its transpose, a cols x rows grid, to dst: chunk (r, c) of src lands
  // at chunk (c, r) of dst. This is Tutel's strideMemcpy and the flexible
  // all-to-all's layout change. dst and src must not overlap.
  void transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) {
    count(counters_, Count::kKernelCalls);
    transpose_chunks_impl(dst, src, rows, cols, chunk_bytes);
  }
  // Many independent copies between two buffers (2DH with uneven counts).
  // `ranges` is host memory.
  void copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count_of_ranges) {
    count(counters_, Count::kKernelCalls);
    copy_ranges_impl(dst, src, ranges, count_of_ranges);
  }

  // --- For transports that move this device's memory through the host
  // (the staged MPI transport) or host messages through the device (the
  // argument check of a NCCL-only communicator). On the CPU these are plain
  // copies and allocations, which is how the CPU tests exercise that code.
  void copy_to_host(void* host_dst, const void* src, size_t bytes) {
    count(counters_, Count::kKernelCalls);
    copy_to_host_impl(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) {
    count(counters_, Count::kKernelCalls);
    copy_from_host_impl(dst, host_src, bytes);
  }
  // Waits until everything enqueued so far has finished. Bounded by timeout_s;
  // `poll` runs between checks (a transport's asynchronous-error check) and may
  // throw.
  void synchronize(double timeout_s, const std::function<void()>& poll = {}) {
    count(counters_, Count::kHostWaits);
    synchronize_impl(timeout_s, poll);
  }
  // Page-locked host memory (staging) and device memory (the control
  // buffer of a NCCL-only communicator).
  void* allocate_host(size_t bytes) {
    count(counters_, Count::kAllocations);
    return allocate_host_impl(bytes);
  }
  void free_host(void* pointer) { free_host_impl(pointer); }
  void* allocate_device(size_t bytes) {
    count(counters_, Count::kAllocations);
    return allocate_device_impl(bytes);
  }
  void free_device(void* pointer) { free_device_impl(pointer); }

 protected:
  virtual void copy_impl(void* dst, const void* src, size_t bytes) = 0;
  virtual void transpose_chunks_impl(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) = 0;
  virtual void copy_ranges_impl(void* dst, const void* src, const CopyRange* ranges, size_t count) = 0;
  virtual void copy_to_host_impl(void* host_dst, const void* src, size_t bytes) { copy_impl(host_dst, src, bytes); }
  virtual void copy_from_host_impl(void* dst, const void* host_src, size_t bytes) { copy_impl(dst, host_src, bytes); }
  virtual void synchronize_impl(double /*timeout_s*/, const std::function<void()>& /*poll*/) {}
  virtual void* allocate_host_impl(size_t bytes);
  virtual void free_host_impl(void* pointer);
  virtual void* allocate_device_impl(size_t bytes) { return allocate_host_impl(bytes); }
  virtual void free_device_impl(void* pointer) { free_host_impl(pointer); }

 private:
  Counters* counters_ = nullptr;
};

// A buffer from Device::allocate_host or allocate_device that grows on demand
// and is freed with the device's matching call. Growing first waits for the
// device, because enqueued copies may still read the old buffer.
class DeviceBuffer {
 public:
  enum class Kind { kHost, kDevice };
  DeviceBuffer(Device& device, Kind kind) : device_(device), kind_(kind) {}
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // At least `bytes` (a pointer to a non-empty buffer even for 0 bytes).
  char* reserve(size_t bytes, double timeout_s);

 private:
  void release();
  Device& device_;
  Kind kind_;
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace a2a
