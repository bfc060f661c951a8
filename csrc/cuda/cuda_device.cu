// The CUDA Device: layout copies as kernels (cuda/layout_cuda.cu) and
// cudaMemcpyAsync on the caller's stream, on the device the communicator was
// made for. Nothing here waits for the stream except synchronize().
#include <cuda_runtime.h>

#include <chrono>
#include <thread>

#include "core/backends.hpp"
#include "core/error.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/layout_cuda.hpp"

namespace a2a {

namespace {

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int device) : device_(device < 0 ? current_cuda_device() : device) {
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (device_ >= devices)
      fail(A2A_ERROR_INVALID_ARGUMENT, "CUDA device ", device_, " does not exist (", devices, " visible)");
  }
  const char* name() const override { return "cuda"; }
  int device() const { return device_; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (device to device)");
  }
  void transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) override {
    const CurrentDevice active = activate();
    check_cuda(static_cast<cudaError_t>(cuda_transpose_chunks(dst, src, rows, cols, chunk_bytes, stream_)),
               "transpose_chunks kernel");
  }
  void copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count) override {
    const CurrentDevice active = activate();
    check_cuda(static_cast<cudaError_t>(cuda_copy_ranges(dst, src, ranges, count, stream_)), "copy_ranges kernel");
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (to host)");
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (from host)");
  }

  // Polls instead of cudaStreamSynchronize, which could wait forever for a
  // NCCL kernel whose peer never comes.
  void synchronize(double timeout_s, const std::function<void()>& poll) override {
    const CurrentDevice active = activate();
    const auto start = std::chrono::steady_clock::now();
    for (int round = 0;; ++round) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) check_cuda(status, "cudaStreamQuery");
      if (poll) poll();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s)
        fail(A2A_ERROR_TIMEOUT, "CUDA device ", device_, ": the stream did not finish within ", timeout_s,
             " s (A2A_TIMEOUT_S)");
      if (round < 1000)
        std::this_thread::yield();  // most waits are short: stay responsive
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  bool capturing() const override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t error = cudaStreamIsCapturing(stream_, &status);
    // The legacy stream, while another stream is captured in global mode.
    if (error == cudaErrorStreamCaptureImplicit) {
      (void)cudaGetLastError();
      return true;
    }
    check_cuda(error, "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }

  void* allocate_host(size_t bytes) override {
    const CurrentDevice active = activate();
    void* pointer = nullptr;
    check_cuda(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable), "cudaHostAlloc (staging buffer)");
    return pointer;
  }
  void free_host(void* pointer) override { (void)cudaFreeHost(pointer); }
  void* allocate_device(size_t bytes) override {
    const CurrentDevice active = activate();
    void* pointer = nullptr;
    check_cuda(cudaMalloc(&pointer, bytes), "cudaMalloc (control buffer)");
    return pointer;
  }
  void free_device(void* pointer) override { (void)cudaFree(pointer); }

 private:
  // Makes the communicator's device current for one call.
  CurrentDevice activate() const { return CurrentDevice(device_); }

  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int cuda_device) { return std::make_unique<CudaDevice>(cuda_device); }

int cuda_device_of(const Device& device) {
  const auto* cuda = dynamic_cast<const CudaDevice*>(&device);
  return cuda != nullptr ? cuda->device() : -1;
}

}  // namespace a2a
