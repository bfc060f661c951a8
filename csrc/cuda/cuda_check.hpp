// Turning CUDA runtime errors into a2a failures, shared by every CUDA source.
#pragma once

#include <cuda_runtime.h>

namespace a2a {

// Errors that mean "no usable CUDA here" (A2A_ERROR_UNSUPPORTED) rather than
// a bug (A2A_ERROR_INTERNAL).
bool cuda_means_unsupported(cudaError_t status);

// Throws a Failure naming `call` unless status is cudaSuccess; clears a
// non-sticky error first so that later calls are not blamed for it.
void check_cuda(cudaError_t status, const char* call);

// check_cuda on cudaGetLastError() after a kernel launch.
void check_launch(const char* kernel);

// True once the CUDA runtime is shutting down (at process exit): destructors
// then leave CUDA and NCCL objects to the process teardown.
bool cuda_is_unloading();

// The calling thread's current device, after checking that one exists.
int current_cuda_device();

// The SM count of `device`, cached per device (it sizes grid-stride grids).
int multiprocessor_count(int device);

// Makes `device` the calling thread's current device for the guard's
// lifetime and restores the caller's afterwards.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};

}  // namespace a2a
