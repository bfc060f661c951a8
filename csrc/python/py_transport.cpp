#include "py_transport.hpp"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace a2a::python {

namespace {

// The pending Python exception as a status, its text copied into error.
int status_of(py::error_already_set& e, char* error, size_t error_size) {
  const std::string text = py::str(e.value());
  const size_t n = std::min(text.size(), error_size - 1);
  std::memcpy(error, text.data(), n);
  error[n] = '\0';
  return e.matches(PyExc_TimeoutError) ? A2A_ERROR_TIMEOUT : A2A_ERROR_TRANSPORT;
}

template <typename Call>
int with_python(char* error, size_t error_size, Call&& call) {
  py::gil_scoped_acquire gil;
  try {
    call();
    return A2A_SUCCESS;
  } catch (py::error_already_set& e) {
    return status_of(e, error, error_size);
  }
}

py::handle object_of(void* user) { return py::handle(static_cast<PyObject*>(user)); }

int isend(void* user, const void* data, size_t bytes, int peer, int tag, int64_t* request, char* error,
          size_t error_size) {
  return with_python(error, error_size, [&] {
    *request = object_of(user).attr("isend")(reinterpret_cast<uintptr_t>(data), bytes, peer, tag).cast<int64_t>();
  });
}

int irecv(void* user, void* data, size_t bytes, int peer, int tag, int64_t* request, char* error, size_t error_size) {
  return with_python(error, error_size, [&] {
    *request = object_of(user).attr("irecv")(reinterpret_cast<uintptr_t>(data), bytes, peer, tag).cast<int64_t>();
  });
}

int wait(void* user, const int64_t* requests, size_t count, double timeout_s, char* error, size_t error_size) {
  return with_python(error, error_size, [&] {
    object_of(user).attr("wait")(std::vector<int64_t>(requests, requests + count), timeout_s);
  });
}

void release(void* user) {
  if (!Py_IsInitialized()) return;  // at interpreter exit the object is gone with it
  py::gil_scoped_acquire gil;
  Py_DECREF(static_cast<PyObject*>(user));
}

}  // namespace

a2a_transport_ops_t python_transport_ops(const py::object& transport, const char* name) {
  a2a_transport_ops_t ops{};
  ops.struct_size = sizeof(ops);
  ops.name = name;
  ops.user = transport.ptr();
  ops.isend = isend;
  ops.irecv = irecv;
  ops.wait = wait;
  ops.release = release;
  Py_INCREF(transport.ptr());
  return ops;
}

}  // namespace a2a::python
