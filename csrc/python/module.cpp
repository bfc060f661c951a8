// a2a._C: a thin pybind11 layer over the C++ API (a2a.hpp). Buffers arrive as
// raw addresses from the Python layer, which owns them for the duration of the
// call; every collective releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "a2a/a2a.hpp"

namespace py = pybind11;

namespace {

const void* as_pointer(uintptr_t address) { return reinterpret_cast<const void*>(address); }
void* as_mutable(uintptr_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of a2a (liba2a). Use the a2a package instead of this module.";

  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const a2a::Error& e) {
      // a2a._errors maps the status code to the matching Python exception.
      py::object exception = py::module_::import("a2a._errors").attr("from_status")(static_cast<int>(e.status()), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
    }
  });

  m.def("build_config", [] { return std::string(a2a_build_config()); });
  // (address, C-contiguous, writeable) of a NumPy array in one call: reading
  // them as Python attributes costs several microseconds per collective.
  m.def("numpy_layout", [](const py::array& array) {
    return py::make_tuple(reinterpret_cast<uintptr_t>(array.data()), (array.flags() & py::array::c_style) != 0,
                          array.writeable());
  });
  m.def("dtype_size", [](int dtype) { return a2a_dtype_size(static_cast<a2a_dtype_t>(dtype)); });

  py::class_<a2a::Communicator>(m, "Comm")
      .def(py::init([](uintptr_t mpi_comm_address, int local_size, double timeout_s, int use_mpi_datatypes) {
             a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
             config.local_size = local_size;
             config.timeout_s = timeout_s;
             config.use_mpi_datatypes = use_mpi_datatypes;
             return new a2a::Communicator(as_pointer(mpi_comm_address), config);
           }),
           py::arg("mpi_comm_address"), py::arg("local_size") = 0, py::arg("timeout_s") = 0.0,
           py::arg("use_mpi_datatypes") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("topology",
                             [](const a2a::Communicator& c) {
                               a2a::Topology t = c.topology();
                               return py::make_tuple(t.rank, t.size, t.local_rank, t.local_size, t.node, t.num_nodes);
                             })
      .def("all_to_all_workspace_size",
           [](const a2a::Communicator& c, size_t count, int dtype, int algo) {
             return c.all_to_all_workspace_size(count, static_cast<a2a_dtype_t>(dtype), static_cast<a2a_algo_t>(algo));
           })
      .def(
          "all_to_all",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, size_t count, int dtype, int algo,
             uintptr_t workspace, size_t workspace_bytes) {
            c.all_to_all(as_pointer(send), as_mutable(recv), count, static_cast<a2a_dtype_t>(dtype),
                         static_cast<a2a_algo_t>(algo), as_mutable(workspace), workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("all_to_all_flex_workspace_size",
           [](const a2a::Communicator& c, const std::vector<int64_t>& shape, int split_axis, int concat_axis, int dtype,
              int algo) {
             return c.all_to_all_flex_workspace_size(shape, split_axis, concat_axis, static_cast<a2a_dtype_t>(dtype),
                                                     static_cast<a2a_algo_t>(algo));
           })
      .def(
          "all_to_all_flex",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, const std::vector<int64_t>& shape, int split_axis,
             int concat_axis, int dtype, int algo, uintptr_t workspace, size_t workspace_bytes) {
            c.all_to_all_flex(as_pointer(send), as_mutable(recv), shape, split_axis, concat_axis,
                              static_cast<a2a_dtype_t>(dtype), static_cast<a2a_algo_t>(algo), as_mutable(workspace),
                              workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "report_invalid", [](a2a::Communicator& c, const std::string& op, const std::string& message) {
            c.report_invalid(op.c_str(), message);
          },
          py::call_guard<py::gil_scoped_release>());

  py::class_<a2a::VPlan>(m, "VPlan")
      .def(py::init([](a2a::Communicator& comm, const std::vector<int64_t>& send_counts, size_t row_elements, int dtype,
                       int algo) {
             return new a2a::VPlan(comm, send_counts, static_cast<a2a_dtype_t>(dtype), static_cast<a2a_algo_t>(algo),
                                   row_elements);
           }),
           py::arg("comm"), py::arg("send_counts"), py::arg("row_elements"), py::arg("dtype"), py::arg("algo"),
           py::keep_alive<1, 2>(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("recv_counts", &a2a::VPlan::recv_counts)
      .def_property_readonly("workspace_size", &a2a::VPlan::workspace_size)
      .def(
          "execute",
          [](a2a::VPlan& plan, uintptr_t send, uintptr_t recv, uintptr_t workspace, size_t workspace_bytes) {
            plan.execute(as_pointer(send), as_mutable(recv), as_mutable(workspace), workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>());
}
