// a2a_exec_t (where a kernel runs) read and checked once for every entry
// point that takes one.
#pragma once

#include <memory>

#include "a2a/a2a.h"
#include "core/device.hpp"

namespace a2a {

// *exec with defaults for fields an older caller did not know; NULL means
// the CPU with the default thread count.
a2a_exec_t read_exec(const a2a_exec_t* exec);

// The Device of an execution place: host copies, or CUDA on exec.stream and
// the current device.
std::unique_ptr<Device> make_device(const a2a_exec_t& exec);

}  // namespace a2a
