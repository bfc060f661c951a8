// a2a._C: a thin pybind11 layer over the C++ API (a2a.hpp). Buffers arrive as
// raw addresses from the Python layer, which owns them for the duration of the
// call; every collective releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "a2a/a2a.hpp"
#include "a2a/a2a_testing.h"

#include "py_transport.hpp"

namespace py = pybind11;

namespace {

const void* as_pointer(uintptr_t address) { return reinterpret_cast<const void*>(address); }

// An a2a_counters_t by name (a2a._counters.Counters' fields).
py::dict counters_dict(const a2a_counters_t& c) {
  py::dict d;
  d["calls"] = c.calls;
  d["collectives"] = c.collectives;
  d["data_rounds"] = c.data_rounds;
  d["data_messages"] = c.data_messages;
  d["control_rounds"] = c.control_rounds;
  d["control_messages"] = c.control_messages;
  d["check_rounds"] = c.check_rounds;
  d["host_waits"] = c.host_waits;
  d["kernel_calls"] = c.kernel_calls;
  d["allocations"] = c.allocations;
  return d;
}

// a2a_dtype_t of a NumPy dtype, or -1 (including ml_dtypes' bfloat16, which
// the general path handles by name).
int numpy_dtype_code(const py::dtype& dtype) {
  if (!dtype.attr("isnative").cast<bool>()) return -1;  // byte-swapped: the general path rejects it
  const char kind = dtype.kind();
  const auto size = dtype.itemsize();
  if (kind == 'f') return size == 4 ? A2A_FLOAT32 : size == 8 ? A2A_FLOAT64 : size == 2 ? A2A_FLOAT16 : -1;
  if (kind == 'i') return size == 1 ? A2A_INT8 : size == 4 ? A2A_INT32 : size == 8 ? A2A_INT64 : -1;
  if (kind == 'u') return size == 1 ? A2A_UINT8 : -1;
  return -1;
}

// The output of a fast NumPy path: a new C-contiguous array of `shape` and
// x's dtype, or `out` when it is exactly that; false when `out` is anything
// else (the general path then checks it and reports the problem).
bool numpy_output(const py::array& x, const py::object& out, const std::vector<py::ssize_t>& shape,
                  py::array* result) {
  if (out.is_none()) {
    *result = py::array(x.dtype(), shape);
    return true;
  }
  if (!py::isinstance<py::array>(out)) return false;
  *result = py::reinterpret_borrow<py::array>(out);
  if (!result->dtype().is(x.dtype()) || result->ndim() != static_cast<py::ssize_t>(shape.size()) ||
      !(result->flags() & py::array::c_style) || !result->writeable())
    return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (result->shape(static_cast<py::ssize_t>(i)) != shape[i]) return false;
  return true;
}

// x's dtype code when x is a well-formed C-contiguous NumPy input, else -1.
int fast_input_code(const py::array& x) {
  if (x.ndim() == 0 || !(x.flags() & py::array::c_style)) return -1;
  return numpy_dtype_code(x.dtype());
}

// The end of every fast path: `call(send, recv, workspace, workspace_bytes)`
// with the GIL released, or None when the cached workspace is too small (the
// general path grows it).
template <typename Call>
py::object run_fast(const py::array& x, py::array result, py::array& workspace, size_t needed, Call&& call) {
  const size_t available = static_cast<size_t>(workspace.nbytes());
  if (needed > available) return py::none();
  const void* send = x.data();
  void* recv = result.mutable_data();
  void* scratch = available ? workspace.mutable_data() : nullptr;
  {
    py::gil_scoped_release release;
    call(send, recv, scratch, available);
  }
  return std::move(result);
}

// The whole of a2a.all_to_all for well-formed NumPy arrays in one native call
// (a collective is latency-bound at small sizes, and Python code between
// calls runs with caches cold from the exchange). Returns None whenever
// anything is unusual, so that the Python layer takes its general path, which
// also reports errors to every rank. The fast paths below do the same.
py::object all_to_all_numpy(a2a::Communicator& comm, const py::array& x, const py::object& out, int algo,
                            py::array& workspace) {
  const int code = fast_input_code(x);
  const int size = comm.topology().size;
  if (code < 0 || x.shape(0) % size != 0) return py::none();
  py::array result;
  if (!numpy_output(x, out, std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()), &result)) return py::none();
  const size_t count = static_cast<size_t>(x.size()) / size;
  const auto dtype = static_cast<a2a_dtype_t>(code);
  const auto algorithm = static_cast<a2a_algo_t>(algo);
  return run_fast(x, result, workspace, comm.all_to_all_workspace_size(count, dtype, algorithm),
                  [&](const void* send, void* recv, void* scratch, size_t bytes) {
                    comm.all_to_all(send, recv, count, dtype, algorithm, scratch, bytes);
                  });
}

// a2a.all_to_all_flex for NumPy arrays; split_axis and concat_axis already
// in [0, ndim).
py::object all_to_all_flex_numpy(a2a::Communicator& comm, const py::array& x, const py::object& out, int split_axis,
                                 int concat_axis, int algo, py::array& workspace) {
  const int code = fast_input_code(x);
  const int size = comm.topology().size;
  const int ndim = static_cast<int>(x.ndim());
  if (code < 0 || split_axis < 0 || split_axis >= ndim || concat_axis < 0 || concat_axis >= ndim ||
      x.shape(split_axis) % size != 0)
    return py::none();
  std::vector<int64_t> shape(x.shape(), x.shape() + ndim);
  std::vector<py::ssize_t> out_shape(x.shape(), x.shape() + ndim);
  out_shape[split_axis] /= size;
  out_shape[concat_axis] *= size;
  py::array result;
  if (!numpy_output(x, out, out_shape, &result)) return py::none();
  const auto dtype = static_cast<a2a_dtype_t>(code);
  const auto algorithm = static_cast<a2a_algo_t>(algo);
  size_t needed = 0;
  try {
    needed = comm.all_to_all_flex_workspace_size(shape, split_axis, concat_axis, dtype, algorithm);
  } catch (const a2a::Error&) {
    return py::none();  // a layout the core rejects: the general path tells every rank
  }
  return run_fast(x, result, workspace, needed, [&](const void* send, void* recv, void* scratch, size_t bytes) {
    comm.all_to_all_flex(send, recv, shape, split_axis, concat_axis, dtype, algorithm, scratch, bytes);
  });
}

// A reused all-to-all-v plan run on NumPy arrays: x of rows_in rows, the
// result of rows_out rows of x's row shape (the plan's dtype is checked by the
// core against row_elements and the dtype it was made with).
py::object v_plan_execute_numpy(a2a::VPlan& plan, const py::array& x, const py::object& out, int64_t rows_in,
                                int64_t rows_out, int dtype, py::array& workspace) {
  if (fast_input_code(x) != dtype || x.shape(0) != rows_in) return py::none();
  std::vector<py::ssize_t> out_shape(x.shape(), x.shape() + x.ndim());
  out_shape[0] = rows_out;
  py::array result;
  if (!numpy_output(x, out, out_shape, &result)) return py::none();
  return run_fast(x, result, workspace, plan.workspace_size(),
                  [&](const void* send, void* recv, void* scratch, size_t bytes) { plan.execute(send, recv, scratch, bytes); });
}

void* as_mutable(uintptr_t address) { return reinterpret_cast<void*>(address); }

// finish() of a VExchange for NumPy input `x` (the array it was started on):
// the output has sum(recv_counts) rows of x's row shape.
py::object v_exchange_finish_numpy(a2a::VExchange& exchange, const py::array& x, const py::object& out,
                                   py::array& workspace) {
  std::vector<py::ssize_t> out_shape(x.shape(), x.shape() + x.ndim());
  out_shape[0] = 0;
  for (int64_t rows : exchange.recv_counts()) out_shape[0] += rows;
  py::array result;
  if (!numpy_output(x, out, out_shape, &result)) return py::none();
  return run_fast(x, result, workspace, exchange.workspace_size(),
                  [&](const void*, void* recv, void* scratch, size_t bytes) { exchange.finish(recv, scratch, bytes); });
}

// a2a.all_to_all_v for NumPy input: starts the exchange and finishes it into
// out= (or a new array). Returns None for input unfit for this path, before
// anything is sent (counts other than one int per rank in [0, max_count]
// summing to x's rows, x not C-contiguous, an out= unfit for any rows),
// else (result, recv_counts, exchange): result None and the open exchange
// when out='s rows or the workspace do not fit what arrived (the Python
// layer finishes or drops it).
py::object all_to_all_v_numpy(a2a::Communicator& comm, const py::array& x, const py::object& counts, int64_t max_count,
                              const py::object& out, int algo, py::array& workspace) {
  const int code = fast_input_code(x);
  if (code < 0 || !py::isinstance<py::list>(counts)) return py::none();
  // Exact ints only, as the general path takes them: pybind would also take a bool as 1.
  for (const py::handle item : counts)
    if (!PyLong_CheckExact(item.ptr())) return py::none();
  std::vector<int64_t> send_counts;
  try {
    send_counts = counts.cast<std::vector<int64_t>>();
  } catch (const py::cast_error&) {
    return py::none();
  }
  int64_t rows = 0;
  for (int64_t count : send_counts) {
    if (count < 0 || count > max_count) return py::none();
    rows += count;
  }
  if (static_cast<int>(send_counts.size()) != comm.topology().size || rows != x.shape(0)) return py::none();
  // An out= that cannot fit any count (another framework, dtype or row
  // shape, not C-contiguous, read-only) takes the general path, which fails
  // every rank; only its rows wait for the exchange.
  if (!out.is_none()) {
    if (!py::isinstance<py::array>(out) || py::reinterpret_borrow<py::array>(out).ndim() != x.ndim()) return py::none();
    std::vector<py::ssize_t> any_rows(x.shape(), x.shape() + x.ndim());
    any_rows[0] = py::reinterpret_borrow<py::array>(out).shape(0);  // its own: only the exchange tells the count
    py::array unused;
    if (!numpy_output(x, out, any_rows, &unused)) return py::none();
  }
  size_t row_elements = 1;
  for (py::ssize_t i = 1; i < x.ndim(); ++i) row_elements *= static_cast<size_t>(x.shape(i));
  std::unique_ptr<a2a::VExchange> exchange;
  {
    py::gil_scoped_release release;
    exchange = std::make_unique<a2a::VExchange>(comm, x.data(), send_counts, static_cast<a2a_dtype_t>(code),
                                                static_cast<a2a_algo_t>(algo), row_elements);
  }
  const std::vector<int64_t>& arrived = exchange->recv_counts();
  py::array_t<int64_t> recv_counts(static_cast<py::ssize_t>(arrived.size()));
  std::copy(arrived.begin(), arrived.end(), recv_counts.mutable_data());
  py::object result = v_exchange_finish_numpy(*exchange, x, out, workspace);
  if (!result.is_none()) return py::make_tuple(result, recv_counts, py::none());
  return py::make_tuple(py::none(), recv_counts, py::cast(exchange.release(), py::return_value_policy::take_ownership));
}


// exec = (device_type, stream address, num_threads) from the Python layer.
a2a_exec_t make_exec(const std::tuple<int, uintptr_t, int>& exec) {
  a2a_exec_t e = A2A_EXEC_CPU_INIT;
  e.device_type = std::get<0>(exec);
  e.stream = as_mutable(std::get<1>(exec));
  e.num_threads = std::get<2>(exec);
  return e;
}

// routing = (T, k, E, indices, index dtype, locations, counts, offsets,
// capacity, num_rows), addresses as integers.
using RoutingTuple = std::tuple<int64_t, int64_t, int64_t, uintptr_t, int, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>;

a2a_routing_t make_routing(const RoutingTuple& r) {
  a2a_routing_t routing{};
  routing.num_tokens = std::get<0>(r);
  routing.top_k = std::get<1>(r);
  routing.num_experts = std::get<2>(r);
  routing.indices = as_pointer(std::get<3>(r));
  routing.index_dtype = static_cast<a2a_dtype_t>(std::get<4>(r));
  routing.locations = static_cast<const int64_t*>(as_pointer(std::get<5>(r)));
  routing.counts = static_cast<const int64_t*>(as_pointer(std::get<6>(r)));
  routing.expert_offsets = static_cast<const int64_t*>(as_pointer(std::get<7>(r)));
  routing.capacity = std::get<8>(r);
  routing.num_rows = std::get<9>(r);
  return routing;
}

using EsIndexTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, uintptr_t, uintptr_t, uintptr_t>;

a2a_es_index_t make_es_index(const EsIndexTuple& t) {
  a2a_es_index_t index{};
  index.num_tokens = std::get<0>(t);
  index.top_k = std::get<1>(t);
  index.num_experts = std::get<2>(t);
  index.tile = std::get<3>(t);
  index.num_slots = std::get<4>(t);
  index.slots = static_cast<const int64_t*>(as_pointer(std::get<5>(t)));
  index.expert_starts = static_cast<const int64_t*>(as_pointer(std::get<6>(t)));
  index.counts = static_cast<const int64_t*>(as_pointer(std::get<7>(t)));
  return index;
}

// DLPack's C structures (dlpack.h, a stable ABI; spelled out here so the
// build needs no DLPack header). A "dltensor" capsule holds a DLManagedTensor.
struct DLDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL = C-contiguous
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// What the Python layer needs from a DLPack capsule, without consuming it:
// the capsule (kept alive by the caller) still owns the tensor.
// Returns (address, shape, C-contiguous, dtype code, bits, lanes, device type, device id).
py::tuple dlpack_view(const py::capsule& capsule) {
  if (std::string(capsule.name() ? capsule.name() : "") != "dltensor")
    throw py::value_error("not an unconsumed DLPack capsule (name 'dltensor')");
  const auto* managed = capsule.get_pointer<DLManagedTensor>();
  const DLTensor& t = managed->dl_tensor;
  py::tuple shape(t.ndim);
  bool contiguous = true;
  int64_t expected = 1;
  for (int32_t i = t.ndim - 1; i >= 0; --i) {
    shape[i] = py::int_(t.shape[i]);
    if (t.strides != nullptr && t.shape[i] != 1 && t.strides[i] != expected) contiguous = false;
    expected *= t.shape[i];
  }
  const uintptr_t address = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  return py::make_tuple(address, shape, contiguous, t.dtype.code, t.dtype.bits, t.dtype.lanes, t.device.device_type,
                        t.device.device_id);
}

a2a_comm_config_t make_config(int local_size, double timeout_s, int use_mpi_datatypes, int device_type, int transport,
                              int cuda_device, int cross_check = -1) {
  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  config.cross_check = cross_check;
  config.local_size = local_size;
  config.timeout_s = timeout_s;
  config.use_mpi_datatypes = use_mpi_datatypes;
  config.device_type = device_type;
  config.transport = transport;
  config.cuda_device = cuda_device;
  return config;
}

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

  m.attr("UNDEFINED") = A2A_UNDEFINED;
  m.def("build_config", [] { return std::string(a2a_build_config()); });
  m.def("process_counters", [] { return counters_dict(a2a::process_counters()); });
  // (address, C-contiguous, writeable) of a NumPy array in one call: reading
  // them as Python attributes costs several microseconds per collective.
  m.def("numpy_layout", [](const py::array& array) {
    return py::make_tuple(reinterpret_cast<uintptr_t>(array.data()), (array.flags() & py::array::c_style) != 0,
                          array.writeable());
  });
  m.def("dtype_size", [](int dtype) { return a2a_dtype_size(static_cast<a2a_dtype_t>(dtype)); });

  using Exec = std::tuple<int, uintptr_t, int>;
  m.def("route_workspace_size", [](const Exec& exec, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
    return a2a::route_workspace_size(make_exec(exec), num_tokens, top_k, num_experts);
  });
  // Returns (capacity, num_rows, num_dropped); host_counts (E int64, host) gets a copy of counts.
  m.def(
      "route",
      [](const Exec& exec, const a2a::Communicator* comm, uintptr_t indices, int index_dtype, int64_t num_tokens,
         int64_t top_k, int64_t num_experts, uintptr_t token_order, int64_t capacity, double capacity_setting,
         uintptr_t workspace, size_t workspace_bytes, uintptr_t locations, uintptr_t counts, uintptr_t offsets,
         uintptr_t host_counts) {
        const a2a_route_info_t info = a2a::route_host_counts(
            make_exec(exec), comm, as_pointer(indices), static_cast<a2a_dtype_t>(index_dtype), num_tokens, top_k,
            num_experts, static_cast<const int64_t*>(as_pointer(token_order)), capacity, capacity_setting,
            as_mutable(workspace), workspace_bytes, static_cast<int64_t*>(as_mutable(locations)),
            static_cast<int64_t*>(as_mutable(counts)), static_cast<int64_t*>(as_mutable(offsets)),
            static_cast<int64_t*>(as_mutable(host_counts)));
        return std::make_tuple(info.capacity, info.num_rows, info.num_dropped);
      },
      py::arg("exec"), py::arg("comm").none(true), py::arg("indices"), py::arg("index_dtype"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("num_experts"), py::arg("token_order"), py::arg("capacity"),
      py::arg("capacity_setting"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("locations"),
      py::arg("counts"), py::arg("offsets"), py::arg("host_counts"), py::call_guard<py::gil_scoped_release>());
  // capacities: one per expert (host); returns (num_rows, num_dropped, the capacities agreed).
  m.def(
      "route_capacities",
      [](const Exec& exec, const a2a::Communicator* comm, uintptr_t indices, int index_dtype, int64_t num_tokens,
         int64_t top_k, int64_t num_experts, uintptr_t token_order, std::vector<int64_t> capacities,
         uintptr_t workspace, size_t workspace_bytes, uintptr_t locations, uintptr_t counts, uintptr_t offsets) {
        if (static_cast<int64_t>(capacities.size()) != num_experts)
          throw std::invalid_argument("route: " + std::to_string(capacities.size()) + " capacities for " +
                                      std::to_string(num_experts) + " experts");
        const a2a_route_info_t info = a2a::route_capacities(
            make_exec(exec), comm, as_pointer(indices), static_cast<a2a_dtype_t>(index_dtype), num_tokens, top_k,
            num_experts, static_cast<const int64_t*>(as_pointer(token_order)), capacities.data(), as_mutable(workspace),
            workspace_bytes, static_cast<int64_t*>(as_mutable(locations)), static_cast<int64_t*>(as_mutable(counts)),
            static_cast<int64_t*>(as_mutable(offsets)), capacities.data());
        return std::make_tuple(info.num_rows, info.num_dropped, capacities);
      },
      py::arg("exec"), py::arg("comm").none(true), py::arg("indices"), py::arg("index_dtype"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("num_experts"), py::arg("token_order"), py::arg("capacities"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("locations"), py::arg("counts"), py::arg("offsets"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "route_fixed",
      [](const Exec& exec, uintptr_t indices, int index_dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
         uintptr_t token_order, int64_t capacity, uintptr_t workspace, size_t workspace_bytes, uintptr_t locations,
         uintptr_t counts, uintptr_t offsets) {
        a2a::route_fixed(make_exec(exec), as_pointer(indices), static_cast<a2a_dtype_t>(index_dtype), num_tokens, top_k,
                         num_experts, static_cast<const int64_t*>(as_pointer(token_order)), capacity,
                         as_mutable(workspace), workspace_bytes, static_cast<int64_t*>(as_mutable(locations)),
                         static_cast<int64_t*>(as_mutable(counts)), static_cast<int64_t*>(as_mutable(offsets)));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "route_fixed_dropped",
      [](const Exec& exec, int64_t num_tokens, int64_t top_k, int64_t num_experts, uintptr_t workspace,
         size_t workspace_bytes) {
        return a2a::route_fixed_dropped(make_exec(exec), num_tokens, top_k, num_experts, as_pointer(workspace),
                                        workspace_bytes);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "moe_dispatch",
      [](const Exec& exec, const RoutingTuple& routing, uintptr_t x, int dtype, int64_t model_dim, uintptr_t gates,
         int gate_dtype, uintptr_t rows) {
        a2a::moe_dispatch(make_exec(exec), make_routing(routing), as_pointer(x), static_cast<a2a_dtype_t>(dtype),
                          model_dim, as_pointer(gates), static_cast<a2a_dtype_t>(gate_dtype), as_mutable(rows));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "moe_combine",
      [](const Exec& exec, const RoutingTuple& routing, uintptr_t rows, int dtype, int64_t model_dim, uintptr_t gates,
         int gate_dtype, uintptr_t y) {
        a2a::moe_combine(make_exec(exec), make_routing(routing), as_pointer(rows), static_cast<a2a_dtype_t>(dtype),
                         model_dim, as_pointer(gates), static_cast<a2a_dtype_t>(gate_dtype), as_mutable(y));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "moe_gate_grad",
      [](const Exec& exec, const RoutingTuple& routing, uintptr_t tokens, uintptr_t rows, int dtype, int64_t model_dim,
         int gate_dtype, uintptr_t grad_gates) {
        a2a::moe_gate_grad(make_exec(exec), make_routing(routing), as_pointer(tokens), as_pointer(rows),
                           static_cast<a2a_dtype_t>(dtype), model_dim, static_cast<a2a_dtype_t>(gate_dtype),
                           as_mutable(grad_gates));
      },
      py::call_guard<py::gil_scoped_release>());

  // The fused top-k gate. A gate travels as (T, E, k, normalize, dtype).
  using GateTuple = std::tuple<int64_t, int64_t, int64_t, bool, int>;
  auto make_gate = [](const GateTuple& t) {
    return a2a_top_k_gate_t{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t) ? 1 : 0,
                            static_cast<a2a_dtype_t>(std::get<4>(t))};
  };
  m.def("top_k_gate_workspace_size", [make_gate](const GateTuple& gate) {
    return a2a::top_k_gate_workspace_size(make_gate(gate));
  });
  m.def(
      "top_k_gate",
      [make_gate](const Exec& exec, const GateTuple& gate, uintptr_t logits, uintptr_t scores, uintptr_t indices,
                  uintptr_t gates, uintptr_t share, uintptr_t l_aux, uintptr_t workspace) {
        a2a::top_k_gate(make_exec(exec), make_gate(gate), as_pointer(logits), as_mutable(scores),
                        static_cast<int64_t*>(as_mutable(indices)), as_mutable(gates), as_mutable(share),
                        as_mutable(l_aux), as_mutable(workspace));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "top_k_gate_backward",
      [make_gate](const Exec& exec, const GateTuple& gate, uintptr_t scores, uintptr_t indices, uintptr_t share,
                  uintptr_t d_gates, uintptr_t d_l_aux, uintptr_t d_logits) {
        a2a::top_k_gate_backward(make_exec(exec), make_gate(gate), as_pointer(scores),
                                 static_cast<const int64_t*>(as_pointer(indices)), as_pointer(share),
                                 as_pointer(d_gates), as_pointer(d_l_aux), as_mutable(d_logits));
      },
      py::call_guard<py::gil_scoped_release>());

  // Expert-specific operators. An index travels as (T, k, E, tile, num_slots, slots, expert_starts, counts).
  // FP8 rows: (rows, cols, block, format, q, q_stride, scales, scale_stride).
  using Fp8Rows = std::tuple<int64_t, int64_t, int64_t, int, uintptr_t, int64_t, uintptr_t, int64_t>;
  auto make_fp8_rows = [](const Fp8Rows& t) {
    return a2a_fp8_rows_t{std::get<0>(t), std::get<1>(t), std::get<2>(t),
                          static_cast<a2a_fp8_format_t>(std::get<3>(t)), as_mutable(std::get<4>(t)), std::get<5>(t),
                          static_cast<float*>(as_mutable(std::get<6>(t))), std::get<7>(t)};
  };
  m.def("fp8_packed_layout", [](int64_t cols, int64_t block) {
    const a2a::Fp8PackedLayout layout = a2a::fp8_packed_layout(cols, block);
    return std::make_tuple(layout.scale_offset, layout.row_bytes);
  });
  m.def(
      "quantize_fp8",
      [make_fp8_rows](const Exec& exec, uintptr_t x, int dtype, const Fp8Rows& rows) {
        a2a::quantize_fp8(make_exec(exec), as_pointer(x), static_cast<a2a_dtype_t>(dtype), make_fp8_rows(rows));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "dequantize_fp8",
      [make_fp8_rows](const Exec& exec, const Fp8Rows& rows, int dtype, uintptr_t y) {
        a2a::dequantize_fp8(make_exec(exec), make_fp8_rows(rows), static_cast<a2a_dtype_t>(dtype), as_mutable(y));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("es_index_capacity", &a2a::es_index_capacity);
  m.def("es_index_workspace_size", [](const Exec& exec, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
    return a2a::es_index_workspace_size(make_exec(exec), num_tokens, top_k, num_experts);
  });
  m.def(
      "es_index",
      [](const Exec& exec, uintptr_t indices, int index_dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
         int64_t tile, uintptr_t workspace, size_t workspace_bytes, uintptr_t slots, int64_t max_slots,
         uintptr_t expert_starts, uintptr_t counts) {
        return a2a::es_index(make_exec(exec), as_pointer(indices), static_cast<a2a_dtype_t>(index_dtype), num_tokens,
                             top_k, num_experts, tile, as_mutable(workspace), workspace_bytes,
                             static_cast<int64_t*>(as_mutable(slots)), max_slots,
                             static_cast<int64_t*>(as_mutable(expert_starts)), static_cast<int64_t*>(as_mutable(counts)));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("esmm_workspace_size", [](const EsIndexTuple& index, int y_rows, int64_t n, int dtype) {
    return a2a::esmm_workspace_size(make_es_index(index), static_cast<a2a_es_rows_t>(y_rows), n,
                                    static_cast<a2a_dtype_t>(dtype));
  });
  m.def(
      "esmm",
      [](const Exec& exec, const EsIndexTuple& index, uintptr_t x, int x_rows, int64_t k, uintptr_t w, int w_layout,
         uintptr_t bias, uintptr_t gates, int gate_dtype, int dtype, int64_t n, uintptr_t y, int y_rows,
         uintptr_t workspace, size_t workspace_bytes) {
        a2a::esmm(make_exec(exec), make_es_index(index), as_pointer(x), static_cast<a2a_es_rows_t>(x_rows), k,
                  as_pointer(w), static_cast<a2a_es_weight_layout_t>(w_layout), as_pointer(bias), as_pointer(gates),
                  static_cast<a2a_dtype_t>(gate_dtype), static_cast<a2a_dtype_t>(dtype), n, as_mutable(y),
                  static_cast<a2a_es_rows_t>(y_rows), as_mutable(workspace), workspace_bytes);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "ess",
      [](const Exec& exec, const EsIndexTuple& index, uintptr_t x, int x_rows, uintptr_t gates, int gate_dtype,
         int dtype, int64_t n, uintptr_t out) {
        a2a::ess(make_exec(exec), make_es_index(index), as_pointer(x), static_cast<a2a_es_rows_t>(x_rows),
                 as_pointer(gates), static_cast<a2a_dtype_t>(gate_dtype), static_cast<a2a_dtype_t>(dtype), n,
                 as_mutable(out));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "estmm",
      [](const Exec& exec, const EsIndexTuple& index, uintptr_t a, int a_rows, int64_t a_dim, uintptr_t b, int b_rows,
         int64_t b_dim, uintptr_t gates, int gate_dtype, int dtype, uintptr_t out) {
        a2a::estmm(make_exec(exec), make_es_index(index), as_pointer(a), static_cast<a2a_es_rows_t>(a_rows), a_dim,
                   as_pointer(b), static_cast<a2a_es_rows_t>(b_rows), b_dim, as_pointer(gates),
                   static_cast<a2a_dtype_t>(gate_dtype), static_cast<a2a_dtype_t>(dtype), as_mutable(out));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("dlpack_view", &dlpack_view);
  m.def("nccl_unique_id", [] {
    const std::vector<char> id = a2a::nccl_unique_id();
    return py::bytes(id.data(), id.size());
  });
  m.def(
      "transpose_chunks",
      [](const Exec& exec, uintptr_t dst, uintptr_t src, size_t rows, size_t cols, size_t chunk_bytes) {
        a2a::transpose_chunks(make_exec(exec), as_mutable(dst), as_pointer(src), rows, cols, chunk_bytes);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "copy_ranges",
      // ranges: an (n, 3) C-contiguous array of uint64, or of int64 with no
      // negative entry, read in place; or a sequence of n (src_offset,
      // dst_offset, bytes) triples of non-negative integers, converted (50-100
      // ns a range). A table of another dtype is refused, not converted: a cast
      // would wrap a negative offset or truncate a float.
      [](const Exec& exec, uintptr_t dst, uintptr_t src, const py::object& ranges) {
        static_assert(sizeof(a2a_copy_range_t) == 3 * sizeof(uint64_t), "a range is three 64-bit words");
        if (!py::isinstance<py::array>(ranges)) {
          std::vector<std::tuple<size_t, size_t, size_t>> triples;
          try {
            triples = ranges.cast<std::vector<std::tuple<size_t, size_t, size_t>>>();
          } catch (const py::cast_error&) {
            throw py::type_error(
                "copy_ranges: ranges must be an (n, 3) uint64 or int64 array, or a sequence of (src_offset, "
                "dst_offset, bytes) triples of non-negative integers");
          }
          std::vector<a2a_copy_range_t> list;
          list.reserve(triples.size());
          for (const auto& r : triples) list.push_back({std::get<0>(r), std::get<1>(r), std::get<2>(r)});
          py::gil_scoped_release released;
          a2a::copy_ranges(make_exec(exec), as_mutable(dst), as_pointer(src), list);
          return;
        }
        const auto table = py::reinterpret_borrow<py::array>(ranges);
        const bool unsigned_table = table.dtype().is(py::dtype::of<uint64_t>());
        if (!unsigned_table && !table.dtype().is(py::dtype::of<int64_t>()))
          throw py::type_error("copy_ranges: a table of ranges must be uint64 or int64, got " +
                               std::string(py::str(table.dtype())));
        if (table.size() != 0 && (table.ndim() != 2 || table.shape(1) != 3))
          throw std::invalid_argument("copy_ranges: ranges must be (n, 3) rows of (src_offset, dst_offset, bytes)");
        if (!(table.flags() & py::array::c_style))
          throw std::invalid_argument("copy_ranges: the table of ranges must be C-contiguous");
        const auto count = static_cast<size_t>(table.size() / 3);
        if (!unsigned_table) {
          const auto* words = static_cast<const int64_t*>(table.data());
          for (size_t i = 0; i < 3 * count; ++i)
            if (words[i] < 0)
              throw std::invalid_argument("copy_ranges: range " + std::to_string(i / 3) + " has a negative entry (" +
                                          std::to_string(words[i]) + ")");
        }
        const auto* rows = static_cast<const a2a_copy_range_t*>(table.data());
        py::gil_scoped_release released;
        a2a::copy_ranges(make_exec(exec), as_mutable(dst), as_pointer(src), rows, count);
      });

  py::class_<a2a::Communicator>(m, "Comm")
      .def(py::init([](uintptr_t mpi_comm_address, int local_size, double timeout_s, int use_mpi_datatypes,
                       int device_type, int transport, int cuda_device, int cross_check) {
             return new a2a::Communicator(as_pointer(mpi_comm_address),
                                          make_config(local_size, timeout_s, use_mpi_datatypes, device_type,
                                                      transport, cuda_device, cross_check));
           }),
           py::arg("mpi_comm_address"), py::arg("local_size") = 0, py::arg("timeout_s") = 0.0,
           py::arg("use_mpi_datatypes") = -1, py::arg("device_type") = 0, py::arg("transport") = 0,
           py::arg("cuda_device") = -1, py::arg("cross_check") = -1, py::call_guard<py::gil_scoped_release>())
      .def_static(
          "from_nccl_id",
          [](const std::string& id, int size, int rank, int local_size, double timeout_s, int cuda_device,
             int cross_check, const py::object& control, const std::string& control_name) {
            if (id.size() != A2A_NCCL_UNIQUE_ID_BYTES)
              throw py::value_error("a NCCL unique id has " + std::to_string(A2A_NCCL_UNIQUE_ID_BYTES) + " bytes, got " +
                                    std::to_string(id.size()));
            a2a_comm_config_t config =
                make_config(local_size, timeout_s, -1, A2A_DEVICE_CUDA, A2A_TRANSPORT_NCCL, cuda_device, cross_check);
            if (control.is_none()) {
              py::gil_scoped_release release;
              return new a2a::Communicator(id.data(), size, rank, config);
            }
            const a2a_transport_ops_t ops = a2a::python::python_transport_ops(control, control_name.c_str());
            py::gil_scoped_release release;  // the callbacks take it back
            return new a2a::Communicator(id.data(), size, rank, ops, config);
          },
          py::arg("id"), py::arg("size"), py::arg("rank"), py::arg("local_size") = 0, py::arg("timeout_s") = 0.0,
          py::arg("cuda_device") = -1, py::arg("cross_check") = -1, py::arg("control") = py::none(),
          py::arg("control_name") = "")
      .def_static(
          "from_transport",
          [](const py::object& transport, const std::string& name, int size, int rank, int local_size,
             double timeout_s, int cross_check) {
            const a2a_comm_config_t config = make_config(local_size, timeout_s, -1, A2A_DEVICE_CPU,
                                                         A2A_TRANSPORT_EXTERNAL, -1, cross_check);
            const a2a_transport_ops_t ops = a2a::python::python_transport_ops(transport, name.c_str());
            py::gil_scoped_release release;  // the callbacks take it back
            return new a2a::Communicator(ops, size, rank, config);
          },
          py::arg("transport"), py::arg("name"), py::arg("size"), py::arg("rank"), py::arg("local_size") = 0,
          py::arg("timeout_s") = 0.0, py::arg("cross_check") = -1)
      .def(
          "split",
          [](a2a::Communicator& c, int color, int key) -> py::object {
            std::optional<a2a::Communicator> child;
            {
              py::gil_scoped_release release;
              child = c.split(color, key);
            }
            if (!child) return py::none();
            return py::cast(std::move(*child));
          },
          py::arg("color"), py::arg("key"))
      .def("set_stream", [](a2a::Communicator& c, uintptr_t stream) { c.set_stream(as_mutable(stream)); })
      .def_property_readonly("device",
                             [](const a2a::Communicator& c) {
                               const auto d = c.device();
                               return py::make_tuple(d.device_type, d.transport, d.cuda_device);
                             })
      .def_property_readonly("mpi_thread_level", &a2a::Communicator::mpi_thread_level)
      .def_property_readonly("irregular_reason", &a2a::Communicator::irregular_reason)
      .def("counters", [](const a2a::Communicator& c) { return counters_dict(c.counters()); })
      .def_property_readonly("cross_check", &a2a::Communicator::cross_check)
      .def_property_readonly("predicts_check", &a2a::Communicator::predicts_check)
      .def("check", &a2a::Communicator::check_posted, py::call_guard<py::gil_scoped_release>())
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
      .def("all_to_all_numpy", &all_to_all_numpy)
      .def("all_to_all_v_numpy", &all_to_all_v_numpy)
      .def("all_to_all_flex_numpy", &all_to_all_flex_numpy)
      .def(
          "all_gather",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, size_t count, int dtype) {
            c.all_gather(as_pointer(send), as_mutable(recv), count, static_cast<a2a_dtype_t>(dtype));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, size_t count, int dtype, int op) {
            c.all_reduce(as_pointer(send), as_mutable(recv), count, static_cast<a2a_dtype_t>(dtype),
                         static_cast<a2a_reduce_op_t>(op));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, size_t count, int dtype, int op) {
            c.reduce_scatter(as_pointer(send), as_mutable(recv), count, static_cast<a2a_dtype_t>(dtype),
                             static_cast<a2a_reduce_op_t>(op));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather_v",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, const std::vector<int64_t>& counts, int dtype) {
            c.all_gather_v(as_pointer(send), as_mutable(recv), counts, static_cast<a2a_dtype_t>(dtype));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter_v",
          [](a2a::Communicator& c, uintptr_t send, uintptr_t recv, const std::vector<int64_t>& counts, int dtype,
             int op) {
            c.reduce_scatter_v(as_pointer(send), as_mutable(recv), counts, static_cast<a2a_dtype_t>(dtype),
                               static_cast<a2a_reduce_op_t>(op));
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

  // Tests only: what a2a._C.Comm(...) makes, with the staging transports over
  // host memory (tests/mpi/conftest.py, under A2A_TEST_STAGING).
  m.def(
      "testing_comm_create_mpi",
      [](const std::string& staging, uintptr_t mpi_comm_address, int local_size, double timeout_s,
         int use_mpi_datatypes, int device_type, int transport, int cuda_device, int cross_check) {
        const a2a_comm_config_t config =
            make_config(local_size, timeout_s, use_mpi_datatypes, device_type, transport, cuda_device, cross_check);
        a2a_comm_t handle = nullptr;
        a2a::check(a2a_testing_comm_create_mpi(as_pointer(mpi_comm_address), &config, staging.c_str(), &handle));
        return a2a::Communicator::adopt(handle);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "testing_comm_create_external_by_round",
      [](const py::object& transport, const std::string& name, int size, int rank, int local_size, double timeout_s,
         int cross_check) {
        const a2a_comm_config_t config =
            make_config(local_size, timeout_s, -1, A2A_DEVICE_CPU, A2A_TRANSPORT_EXTERNAL, -1, cross_check);
        const a2a_transport_ops_t ops = a2a::python::python_transport_ops(transport, name.c_str());
        a2a_comm_t handle = nullptr;
        {
          py::gil_scoped_release release;  // the callbacks take it back
          a2a::check(a2a_testing_comm_create_external_by_round(&ops, size, rank, &config, &handle));
        }
        return a2a::Communicator::adopt(handle);
      });

  py::class_<a2a::LowLatency>(m, "LowLatency")
      .def(py::init([](a2a::Communicator& comm, int64_t max_tokens, int64_t num_experts, int64_t top_k,
                       int64_t row_bytes, int64_t model_dim, int dtype) {
             a2a_low_latency_config_t config = A2A_LOW_LATENCY_CONFIG_INIT;
             config.max_tokens = max_tokens;
             config.num_experts = num_experts;
             config.top_k = top_k;
             config.row_bytes = row_bytes;
             config.model_dim = model_dim;
             config.dtype = static_cast<a2a_dtype_t>(dtype);
             return new a2a::LowLatency(comm, config);
           }),
           py::keep_alive<1, 2>(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("workspace_size", &a2a::LowLatency::workspace_size)
      .def_property_readonly("expert_capacity", &a2a::LowLatency::expert_capacity)
      .def(
          "dispatch",
          [](a2a::LowLatency& ll, const Exec& exec, uintptr_t workspace, size_t workspace_bytes, uintptr_t x,
             int64_t num_tokens, uintptr_t indices, int index_dtype, uintptr_t recv, uintptr_t recv_counts) {
            ll.dispatch(make_exec(exec), as_mutable(workspace), workspace_bytes, as_pointer(x), num_tokens,
                        as_pointer(indices), static_cast<a2a_dtype_t>(index_dtype), as_mutable(recv),
                        static_cast<int64_t*>(as_mutable(recv_counts)));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine",
          [](a2a::LowLatency& ll, const Exec& exec, uintptr_t workspace, size_t workspace_bytes, uintptr_t expert_out,
             uintptr_t gates, int gate_dtype, uintptr_t y) {
            ll.combine(make_exec(exec), as_mutable(workspace), workspace_bytes, as_pointer(expert_out),
                       as_pointer(gates), static_cast<a2a_dtype_t>(gate_dtype), as_mutable(y));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "check",
          [](a2a::LowLatency& ll, const Exec& exec, uintptr_t workspace, size_t workspace_bytes) {
            ll.check_status(make_exec(exec), as_pointer(workspace), workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>());
  py::class_<a2a::VExchange>(m, "VExchange")
      .def(py::init([](a2a::Communicator& comm, uintptr_t send, const std::vector<int64_t>& send_counts,
                       size_t row_elements, int dtype, int algo) {
             return new a2a::VExchange(comm, as_pointer(send), send_counts, static_cast<a2a_dtype_t>(dtype),
                                       static_cast<a2a_algo_t>(algo), row_elements);
           }),
           py::arg("comm"), py::arg("send"), py::arg("send_counts"), py::arg("row_elements"), py::arg("dtype"),
           py::arg("algo"), py::keep_alive<1, 2>(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("recv_counts", &a2a::VExchange::recv_counts)
      .def_property_readonly("workspace_size", &a2a::VExchange::workspace_size)
      .def(
          "finish",
          [](a2a::VExchange& exchange, uintptr_t recv, uintptr_t workspace, size_t workspace_bytes) {
            exchange.finish(as_mutable(recv), as_mutable(workspace), workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("drop", &a2a::VExchange::drop, py::call_guard<py::gil_scoped_release>());
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
      .def("execute_numpy", &v_plan_execute_numpy)
      .def(
          "execute",
          [](a2a::VPlan& plan, uintptr_t send, uintptr_t recv, uintptr_t workspace, size_t workspace_bytes) {
            plan.execute(as_pointer(send), as_mutable(recv), as_mutable(workspace), workspace_bytes);
          },
          py::call_guard<py::gil_scoped_release>());
}
