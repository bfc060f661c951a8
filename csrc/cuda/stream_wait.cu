#include "cuda/stream_wait.hpp"

#include "core/poll.hpp"
#include "cuda/cuda_check.hpp"

namespace a2a {

bool wait_for_stream(cudaStream_t stream, double timeout_s, const std::function<void()>& poll) {
  return poll_until(timeout_s, [&] {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) check_cuda(status, "cudaStreamQuery");
    if (poll) poll();
    return false;
  });
}

}  // namespace a2a
