// Factories of the optional backends. Each is compiled only where its
// toolkit was found (A2A_WITH_CUDA, A2A_WITH_NCCL); without it the factory
// fails with A2A_ERROR_UNSUPPORTED naming the build setting to change.
#pragma once

#include <cstddef>
#include <memory>

#include "core/device.hpp"
#include "core/transport.hpp"

namespace a2a {

// CUDA kernels and copies on `cuda_device` (-1: the calling thread's current
// device), enqueued on the stream given to set_stream.
std::unique_ptr<Device> make_cuda_device(int cuda_device);
// The device a CUDA Device runs on (for reporting); -1 for other devices.
int cuda_device_of(const Device& device);

constexpr size_t kNcclUniqueIdBytes = 128;
// ncclGetUniqueId into `id` (kNcclUniqueIdBytes bytes).
void nccl_unique_id(void* id);
// One NCCL communicator of `size` ranks from `id`, on `cuda_device`. The
// creation is collective and bounded by timeout_s.
std::unique_ptr<Transport> make_nccl_transport(const void* id, int size, int rank, int cuda_device, double timeout_s);
// ncclCommSplit of `parent` (a transport from make_nccl_transport or from
// this function), collective over its ranks: the new NCCL transport of the
// ranks of `color`, ordered by key, on the parent's device and timeout; nullptr
// for color A2A_UNDEFINED. Bounded by the timeout; a failure aborts `parent`.
std::unique_ptr<Transport> split_nccl_transport(Transport& parent, int color, int key);

}  // namespace a2a
