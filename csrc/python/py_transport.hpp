// a2a_transport_ops_t over a Python object (a2a._torch_transport's), for
// a2a.Comm.from_torch on CPU tensors: the callbacks take the GIL and call the
// object's isend(address, bytes, peer, tag) -> request, irecv(...) -> request
// and wait(requests, timeout_s). A Python TimeoutError becomes
// A2A_ERROR_TIMEOUT, any other exception A2A_ERROR_TRANSPORT, with its text.
#pragma once

#include <pybind11/pybind11.h>

#include "a2a/a2a.h"

namespace a2a::python {

// Holds a reference to `transport` until the ops are released.
a2a_transport_ops_t python_transport_ops(const pybind11::object& transport, const char* name);

}  // namespace a2a::python
