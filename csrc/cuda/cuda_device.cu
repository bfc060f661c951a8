// The CUDA Device: layout copies as kernels (cuda/layout_cuda.cu) and
// cudaMemcpyAsync on the caller's stream, on the device the communicator was
// made for. Nothing here waits for the stream except synchronize().
#include <cuda_runtime.h>


#include "core/error.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/layout_cuda.hpp"
#include "cuda/stream_wait.hpp"
#include "setup/backends.hpp"

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
  ~CudaDevice() override {
    if (switch_event_ != nullptr) (void)cudaEventDestroy(switch_event_);
  }

  // The communicator's buffers (workspace, staging) may still be in use by
  // work on the previous stream: the new stream is ordered after it with an
  // event, without waiting on the host. Not while either stream is being
  // captured: a capture may not wait for work outside it (and a captured
  // call's buffers are the graph's business).
  void set_stream(void* stream) override {
    const auto next = static_cast<cudaStream_t>(stream);
    if (next == stream_) return;
    // The first stream given needs no ordering: creation waited for its own work.
    if (stream_set_ && !is_capturing(stream_) && !is_capturing(next)) {
      const CurrentDevice active = activate();
      if (switch_event_ == nullptr)
        check_cuda(cudaEventCreateWithFlags(&switch_event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      check_cuda(cudaEventRecord(switch_event_, stream_), "cudaEventRecord (previous stream)");
      check_cuda(cudaStreamWaitEvent(next, switch_event_, 0), "cudaStreamWaitEvent (next stream)");
    }
    stream_ = next;
    stream_set_ = true;
  }


 protected:
  void copy_impl(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (device to device)");
  }
  void transpose_chunks_impl(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) override {
    const CurrentDevice active = activate();
    check_cuda(static_cast<cudaError_t>(cuda_transpose_chunks(dst, src, rows, cols, chunk_bytes, stream_)),
               "transpose_chunks kernel");
  }
  void copy_ranges_impl(void* dst, const void* src, const CopyRange* ranges, size_t count) override {
    const CurrentDevice active = activate();
    check_cuda(static_cast<cudaError_t>(cuda_copy_ranges(dst, src, ranges, count, stream_)), "copy_ranges kernel");
  }
  void copy_to_host_impl(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (to host)");
  }
  void copy_from_host_impl(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    const CurrentDevice active = activate();
    check_cuda(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (from host)");
  }

  // Polls instead of cudaStreamSynchronize, which could wait forever for a
  // NCCL kernel whose peer never comes.
  void synchronize_impl(double timeout_s, const std::function<void()>& poll) override {
    if (cuda_is_unloading()) return;  // process exit: nothing can run any more
    const CurrentDevice active = activate();
    if (!wait_for_stream(stream_, timeout_s, poll))
      fail(A2A_ERROR_TIMEOUT, "CUDA device ", device_, ": the stream did not finish within ", timeout_s,
           " s (A2A_TIMEOUT_S)");
  }

 public:
  bool capturing() const override { return is_capturing(stream_); }
  static bool is_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t error = cudaStreamIsCapturing(stream, &status);
    // The legacy stream, while another stream is captured in global mode.
    if (error == cudaErrorStreamCaptureImplicit) {
      (void)cudaGetLastError();
      return true;
    }
    check_cuda(error, "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }


 protected:
  void* allocate_host_impl(size_t bytes) override {
    const CurrentDevice active = activate();
    void* pointer = nullptr;
    check_cuda(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable), "cudaHostAlloc (staging buffer)");
    return pointer;
  }
  void free_host_impl(void* pointer) override { (void)cudaFreeHost(pointer); }
  void* allocate_device_impl(size_t bytes) override {
    const CurrentDevice active = activate();
    void* pointer = nullptr;
    check_cuda(cudaMalloc(&pointer, bytes), "cudaMalloc (control buffer)");
    return pointer;
  }
  void free_device_impl(void* pointer) override { (void)cudaFree(pointer); }

 private:
  // Makes the communicator's device current for one call.
  CurrentDevice activate() const { return CurrentDevice(device_); }

  int device_;
  cudaStream_t stream_ = nullptr;
  bool stream_set_ = false;
  cudaEvent_t switch_event_ = nullptr;  // orders a new stream after the previous one
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int cuda_device) { return std::make_unique<CudaDevice>(cuda_device); }

int cuda_device_of(const Device& device) {
  const auto* cuda = dynamic_cast<const CudaDevice*>(&device);
  return cuda != nullptr ? cuda->device() : -1;
}

}  // namespace a2a
