#include "setup/exec.hpp"

#include <cstddef>
#include <cstring>

#include "core/error.hpp"
#include "cpu/cpu_device.hpp"
#include "setup/backends.hpp"

namespace a2a {

a2a_exec_t read_exec(const a2a_exec_t* exec) {
  a2a_exec_t e = A2A_EXEC_CPU_INIT;
  if (exec == nullptr) return e;
  if (exec->struct_size < offsetof(a2a_exec_t, stream) + sizeof(void*) || exec->struct_size > sizeof(a2a_exec_t))
    fail(A2A_ERROR_INVALID_ARGUMENT, "exec->struct_size ", exec->struct_size,
         " is not a size this library knows; start from A2A_EXEC_CPU_INIT");
  std::memcpy(&e, exec, exec->struct_size);
  if (e.device_type != A2A_DEVICE_CPU && e.device_type != A2A_DEVICE_CUDA)
    fail(A2A_ERROR_INVALID_ARGUMENT, "exec->device_type ", e.device_type,
         " is neither A2A_DEVICE_CPU nor A2A_DEVICE_CUDA");
  if (e.device_type == A2A_DEVICE_CPU && e.num_threads < 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "exec->num_threads is ", e.num_threads);
  return e;
}

std::unique_ptr<Device> make_device(const a2a_exec_t& exec) {
  if (exec.device_type == A2A_DEVICE_CPU) return std::make_unique<CpuDevice>();
  auto device = make_cuda_device(-1);
  device->set_stream(exec.stream);
  return device;
}

}  // namespace a2a
