#include "cuda/cuda_check.hpp"

#include <mutex>
#include <vector>

#include "core/error.hpp"

#ifndef A2A_CUDA_ARCHS_STRING
#define A2A_CUDA_ARCHS_STRING "unknown"
#endif

namespace a2a {

bool cuda_means_unsupported(cudaError_t status) {
  switch (status) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable: return true;
    default: return false;
  }
}

void check_cuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  const char* hint = status == cudaErrorNoKernelImageForDevice || status == cudaErrorUnsupportedPtxVersion
                         ? "; this a2a was built for CUDA architectures " A2A_CUDA_ARCHS_STRING
                           " (A2A_CUDA_ARCHS when building)"
                         : "";
  fail(cuda_means_unsupported(status) ? A2A_ERROR_UNSUPPORTED : A2A_ERROR_INTERNAL, "CUDA call ", call, " failed: ",
       cudaGetErrorString(status), " (", cudaGetErrorName(status), ")", hint);
}

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) check_cuda(status, cat("<<<>>> launch of ", kernel).c_str());
}

bool cuda_is_unloading() {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status == cudaErrorCudartUnloading || status == cudaErrorContextIsDestroyed) {
    (void)cudaGetLastError();
    return true;
  }
  return false;
}

int current_cuda_device() {
  int devices = 0;
  check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (devices < 1) fail(A2A_ERROR_UNSUPPORTED, "CUDA: no CUDA device is visible");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

int multiprocessor_count(int device) {
  static std::mutex mutex;
  static std::vector<int> counts;  // 0: not looked up yet
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 0) fail(A2A_ERROR_INVALID_ARGUMENT, "CUDA device ", device, " is negative");
  if (static_cast<size_t>(device) >= counts.size()) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
    counts[device] = sms > 0 ? sms : 1;
  }
  return counts[device];
}

CurrentDevice::CurrentDevice(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device)
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
  else
    previous_ = -1;
}

CurrentDevice::~CurrentDevice() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

}  // namespace a2a
