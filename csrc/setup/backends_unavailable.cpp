// The optional backends' factories in a build without them: each fails with
// A2A_ERROR_UNSUPPORTED and says how to build it in.
#include "core/error.hpp"
#include "moe/kernels.hpp"
#include "setup/backends.hpp"

namespace a2a {

#if !A2A_HAVE_CUDA
namespace {
[[noreturn]] void no_cuda() {
  fail(A2A_ERROR_UNSUPPORTED, "this a2a was built without CUDA (a2a.config()['cuda'] is False); rebuild with nvcc "
                              "available, or A2A_WITH_CUDA=1 to make that a requirement");
}
}  // namespace

std::unique_ptr<Device> make_cuda_device(int) { no_cuda(); }
int cuda_device_of(const Device&) { return -1; }
namespace moe {
std::unique_ptr<Kernels> make_cuda_kernels(void*, double) { no_cuda(); }
}  // namespace moe
#endif

#if !A2A_HAVE_NCCL
namespace {
[[noreturn]] void no_nccl() {
  fail(A2A_ERROR_UNSUPPORTED, "this a2a was built without NCCL (a2a.config()['nccl'] is False); install "
                              "nvidia-nccl-cu13 (or point NCCL_ROOT at a NCCL) and rebuild, or use "
                              "transport='mpi' to stage CUDA buffers through host memory");
}
}  // namespace

void nccl_unique_id(void*) { no_nccl(); }
std::unique_ptr<Transport> make_nccl_transport(const void*, int, int, int, double) { no_nccl(); }
std::unique_ptr<Transport> split_nccl_transport(Transport&, int, int) { no_nccl(); }
#endif

}  // namespace a2a
