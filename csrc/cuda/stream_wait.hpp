// Waiting for a CUDA stream with a bound: cudaStreamQuery polled with a
// timeout, never cudaStreamSynchronize, which would wait forever behind a
// kernel that never ends (a NCCL kernel whose peer never comes).
#pragma once

#include <cuda_runtime.h>

#include <functional>

namespace a2a {

// True once everything enqueued on `stream` so far has finished; false when
// timeout_s seconds pass first. `poll` (may be empty) runs between queries
// and may throw (a transport's asynchronous error); a CUDA error throws.
bool wait_for_stream(cudaStream_t stream, double timeout_s, const std::function<void()>& poll = {});

}  // namespace a2a
