// moe_cuda.cu's kernels, through its Kernels backend (make_cuda_kernels), run
// by the CUDA emulation of include/ (see run.py) against the CPU backend
// (cpu/moe_cpu.cpp, make_cpu_kernels) on the same inputs:
//   - route's location scan (locate: the order check, the tile histogram, the
//     Blelloch scan over tiles in chunks with a carry, the tile assignment,
//     the error-values kernel): locations, demand and the error message,
//     bitwise, for int32 and int64 indices (the extreme values included),
//     unrouted choices, batch-prioritized token orders, bad indices and bad
//     orders; the same scan at a fixed capacity and packed (locate_fixed:
//     counts, offsets and the dropped count made on the device, the packed
//     offsets a block scan of runs of experts, the fault kept there and
//     read by fixed_result), bad inputs included;
//   - dispatch (encode; permute when dropless) with the padding zeroed, for
//     dropless, one-capacity (with drops) and per-expert-capacity layouts;
//     combine (decode; unpermute), top_k up to 8 and beyond (the kMany path);
//     with no gates, float32 gates and gates of the data's dtype: bitwise, as
//     both backends take the same per-element products (rounded alone: the
//     CUDA side's mul_rn) and sums in the same order, from 0;
//   - gate_grad: the CPU sums a dot product over 8 partial sums, the kernel
//     over `lanes` strided partial sums and a butterfly (and the GPU fuses its
//     products into FMAs), so the two differ in rounding only. Each is within
//     gamma(M + 2) * sum |a_i b_i| of the exact dot (gamma(n) = n u / (1 - n u),
//     u the accumulator's unit roundoff: 2^-24, or 2^-53 for float64), so they
//     are within twice that of each other, plus the final store's rounding to
//     the gate dtype (u_gate * (|cpu| + |cuda|), and half the float16
//     subnormal spacing): the bound checked here;
// for float32, float16, bfloat16 and float64, model dims 0, 1, 7, 8, 9, 1000
// and 4099, pointers misaligned by whole elements (scalar heads, mixed
// misalignment: scalar rows), 0 tokens, and grids of 16 to 48 blocks so that
// the grid-stride loops turn. Outputs have guard bytes on both sides.
// `moe_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "check.hpp"
#include "cuda/es_cuda.hpp"
#include "moe/kernels.hpp"

// moe_cuda.cu's expert-specific, FP8, low-latency and top-k gate overrides
// only forward to es_cuda.cu, fp8_cuda.cu, low_latency_cuda.cu and
// gating_cuda.cu, which es_cuda_check, fp8_cuda_check, low_latency_cuda_check
// and gating_cuda_check run.
namespace a2a::moe {
void cuda_es_scatter_slots(const EsLaunch&, const RouteProblem&, const int64_t*, const int64_t*, int64_t, int64_t*) {
  emu::fatal("es operators are checked by es_cuda_check");
}
void cuda_esmm(const EsLaunch&, const a2a_es_index_t&, const EsMatmul&) { emu::fatal("see es_cuda_check"); }
void cuda_ess(const EsLaunch&, const a2a_es_index_t&, const EsOperand&, const EsGates&, a2a_dtype_t, void*) {
  emu::fatal("see es_cuda_check");
}
void cuda_estmm(const EsLaunch&, const a2a_es_index_t&, const EsOperand&, const EsOperand&, const EsGates&,
                a2a_dtype_t, void*) {
  emu::fatal("see es_cuda_check");
}
void cuda_quantize_fp8(const EsLaunch&, const void*, a2a_dtype_t, const a2a_fp8_rows_t&) {
  emu::fatal("see fp8_cuda_check");
}
void cuda_dequantize_fp8(const EsLaunch&, const a2a_fp8_rows_t&, a2a_dtype_t, void*) {
  emu::fatal("see fp8_cuda_check");
}
void cuda_low_latency_pack(const EsLaunch&, const LowLatencyLayout&, const void*, int64_t, const void*, a2a_dtype_t,
                           uint32_t, char*) {
  emu::fatal("see low_latency_cuda_check");
}
void cuda_low_latency_reject(const EsLaunch&, const LowLatencyLayout&, uint32_t, uint32_t, char*) {
  emu::fatal("see low_latency_cuda_check");
}
void cuda_low_latency_unpack(const EsLaunch&, const LowLatencyLayout&, uint32_t, char*, void*, int64_t*) {
  emu::fatal("see low_latency_cuda_check");
}
void cuda_low_latency_return(const EsLaunch&, const LowLatencyLayout&, const void*, uint32_t, char*) {
  emu::fatal("see low_latency_cuda_check");
}
void cuda_low_latency_combine(const EsLaunch&, const LowLatencyLayout&, int64_t, const void*, a2a_dtype_t, uint32_t,
                              char*, void*) {
  emu::fatal("see low_latency_cuda_check");
}
LowLatencyStatus cuda_low_latency_status(const EsLaunch&, const LowLatencyLayout&, const char*, double) {
  emu::fatal("see low_latency_cuda_check");
}
void cuda_top_k_gate(const EsLaunch&, const a2a_top_k_gate_t&, const void*, void*, int64_t*, void*, void*, void*,
                     void*) {
  emu::fatal("see gating_cuda_check");
}
void cuda_top_k_gate_backward(const EsLaunch&, const a2a_top_k_gate_t&, const void*, const int64_t*, const void*,
                              const void*, const void*, void*) {
  emu::fatal("see gating_cuda_check");
}
}  // namespace a2a::moe

using namespace check;
using namespace a2a;
using namespace a2a::moe;

namespace {

long long route_errors, dropped_cases, per_expert_cases, ordered_cases, many_cases, fixed_faults;

struct Route {
  int64_t T = 0, k = 0, E = 0;
  a2a_dtype_t index_dtype = A2A_INT64;
  std::vector<int64_t> indices64;
  std::vector<int32_t> indices32;
  std::vector<int64_t> order;  // empty: none
  std::vector<int64_t> locations, demand, counts, offsets;
  int64_t capacity = A2A_CAPACITY_DROPLESS, num_rows = 0;
  std::string what;

  const void* indices() const {
    return index_dtype == A2A_INT32 ? static_cast<const void*>(indices32.data()) : indices64.data();
  }
  a2a_routing_t routing() const {
    return {T, k, E, indices(), index_dtype, locations.data(), counts.data(), offsets.data(), capacity, num_rows};
  }
};

// locate on both backends; false when the inputs were (meant to be) bad.
bool locate(Route& r) {
  const RouteProblem problem{r.indices(), r.index_dtype, r.T, r.k, r.E, r.order.empty() ? nullptr : r.order.data()};
  const int64_t choices = r.T * r.k;
  auto cpu = make_cpu_kernels(1);
  auto gpu = make_cuda_kernels(nullptr, 10.0);
  std::vector<char> cpu_workspace(cpu->locate_workspace_size(r.T, r.k, r.E));
  Guarded gpu_workspace(gpu->locate_workspace_size(r.T, r.k, r.E), static_cast<size_t>(below(4)) * 8);
  Guarded gpu_locations(static_cast<size_t>(choices) * 8, 0), cpu_locations(static_cast<size_t>(choices) * 8, 0);
  std::vector<int64_t> cpu_demand, gpu_demand, demand_out(static_cast<size_t>(r.E), -7);
  std::string cpu_error;
  try {
    cpu->locate(problem, cpu_workspace.data(), cpu_workspace.size(), cpu_locations.as<int64_t>(), cpu_demand);
  } catch (const Failure& failure) {
    cpu_error = failure.what();
  }
  ++cases;
  const std::string gpu_error =
      two_schedules(r.what, {{gpu_locations.data(), gpu_locations.bytes()}, {demand_out.data(), demand_out.size() * 8}},
                    [&] {
                      gpu->locate(problem, gpu_workspace.data(), gpu_workspace.bytes(), gpu_locations.as<int64_t>(),
                                  gpu_demand);
                      std::copy(gpu_demand.begin(), gpu_demand.end(), demand_out.begin());
                    });
  expect(gpu_error == cpu_error, "%s: error '%s', the CPU's '%s'", r.what.c_str(), gpu_error.c_str(),
         cpu_error.c_str());
  expect(gpu_workspace.guards_intact() && gpu_locations.guards_intact(), "%s: wrote outside the workspace or locations",
         r.what.c_str());
  if (!cpu_error.empty()) {
    ++route_errors;
    // A bad token_order fails before either backend writes a location (an
    // index out of range fails after the CUDA scan has written them).
    if (cpu_error.find("token_order") != std::string::npos)
      expect(std::equal(gpu_locations.data(), gpu_locations.data() + gpu_locations.bytes(), cpu_locations.data()),
             "%s: a bad token_order changed locations", r.what.c_str());
    return false;
  }
  expect(std::equal(gpu_locations.data(), gpu_locations.data() + gpu_locations.bytes(), cpu_locations.data()),
         "%s: locations differ from the CPU's", r.what.c_str());
  expect(gpu_demand == cpu_demand, "%s: demand differs from the CPU's", r.what.c_str());
  r.locations.assign(cpu_locations.as<int64_t>(), cpu_locations.as<int64_t>() + choices);
  r.demand = cpu_demand;
  return true;
}

// locate_fixed on both backends at a capacity that drops some choices or none,
// and packed (A2A_CAPACITY_DROPLESS): locations, counts, offsets, the dropped
// count and the deferred fault, bitwise; bad indices and orders included (then
// nothing may be out of bounds).
void locate_fixed(const Route& r, int64_t capacity) {
  const RouteProblem problem{r.indices(), r.index_dtype, r.T, r.k, r.E, r.order.empty() ? nullptr : r.order.data()};
  const int64_t choices = r.T * r.k;
  auto cpu = make_cpu_kernels(1);
  auto gpu = make_cuda_kernels(nullptr, 10.0);
  std::vector<char> cpu_workspace(cpu->locate_workspace_size(r.T, r.k, r.E));
  Guarded gpu_workspace(gpu->locate_workspace_size(r.T, r.k, r.E), static_cast<size_t>(below(4)) * 8);
  const size_t table_bytes = static_cast<size_t>(choices + 2 * r.E + 1) * 8;  // locations, counts, offsets
  Guarded cpu_tables(table_bytes, 0), gpu_tables(table_bytes, 0);
  auto run = [&](Kernels& kernels, void* workspace, size_t bytes, Guarded& tables) {
    int64_t* locations = tables.as<int64_t>();
    kernels.locate_fixed(problem, workspace, bytes, capacity, locations, locations + choices,
                         locations + choices + r.E);
  };
  ++cases;
  run(*cpu, cpu_workspace.data(), cpu_workspace.size(), cpu_tables);
  const auto [cpu_fault, cpu_dropped] = cpu->fixed_result(cpu_workspace.data());
  std::pair<ScanFault, int64_t> gpu_result;
  const std::string error = two_schedules(r.what + " fixed", {{gpu_tables.data(), gpu_tables.bytes()}}, [&] {
    run(*gpu, gpu_workspace.data(), gpu_workspace.bytes(), gpu_tables);
    gpu_result = gpu->fixed_result(gpu_workspace.data());
  });
  const auto& [gpu_fault, gpu_dropped] = gpu_result;
  expect(error.empty(), "%s fixed: %s", r.what.c_str(), error.c_str());
  expect(gpu_workspace.guards_intact() && gpu_tables.guards_intact(), "%s fixed: wrote outside its buffers",
         r.what.c_str());
  expect(std::equal(gpu_tables.data(), gpu_tables.data() + gpu_tables.bytes(), cpu_tables.data()),
         "%s fixed capacity %ld: tables differ from the CPU's", r.what.c_str(), capacity);
  expect(gpu_dropped == cpu_dropped, "%s fixed: %ld dropped, the CPU's %ld", r.what.c_str(), gpu_dropped,
         cpu_dropped);
  expect(gpu_fault.bad_choice == cpu_fault.bad_choice && gpu_fault.bad_choice_value == cpu_fault.bad_choice_value &&
             gpu_fault.bad_order_entry == cpu_fault.bad_order_entry &&
             (cpu_fault.bad_order_entry < 0 || gpu_fault.bad_order_value == cpu_fault.bad_order_value),
         "%s fixed: the deferred fault differs from the CPU's", r.what.c_str());
  fixed_faults += cpu_fault.bad_choice >= 0 || cpu_fault.bad_order_entry >= 0;
}

// route's host side (moe/moe.cpp): counts and offsets for a capacity mode.
void layout(Route& r) {
  const int64_t E = r.E;
  const int64_t most = E == 0 ? 0 : *std::max_element(r.demand.begin(), r.demand.end());
  std::vector<int64_t> capacities(static_cast<size_t>(E));
  const int mode = static_cast<int>(rng() % 3);
  r.capacity = mode == 0   ? A2A_CAPACITY_DROPLESS
               : mode == 1 ? std::max<int64_t>(1, pick({1, 2, 3}) * most / 3 + below(3))  // drops when below demand
                           : A2A_CAPACITY_PER_EXPERT;
  for (int64_t e = 0; e < E; ++e)
    capacities[e] = mode == 0 ? r.demand[e] : mode == 1 ? r.capacity : below(r.demand[e] + 3);  // 0: no rows
  r.counts.assign(static_cast<size_t>(E), 0);
  r.offsets.assign(static_cast<size_t>(E) + 1, 0);
  int64_t dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    r.counts[e] = std::min(r.demand[e], capacities[e]);
    dropped += r.demand[e] - r.counts[e];
    r.offsets[e + 1] = r.offsets[e] + capacities[e];
  }
  r.num_rows = r.offsets[E];
  dropped_cases += dropped > 0;
  per_expert_cases += mode == 2;
}

template <typename T>
struct Gates {
  int mode = 0;  // 0 none, 1 float32, 2 the data's dtype
  std::vector<float> f32;
  std::vector<T> data;
  Gates(int64_t choices, int m) : mode(m), f32(static_cast<size_t>(choices)), data(static_cast<size_t>(choices)) {
    for (int64_t c = 0; c < choices; ++c) {
      f32[c] = static_cast<float>(std::normal_distribution<double>(0, 1)(rng));
      data[c] = normal_value<T>();
    }
  }
  const void* pointer() const {
    return mode == 0 ? nullptr : mode == 1 ? static_cast<const void*>(f32.data()) : data.data();
  }
  a2a_dtype_t dtype() const { return mode == 2 ? dtype_of<T>() : A2A_FLOAT32; }
};

template <typename T>
void random_fill(Guarded& buffer) {
  for (size_t i = 0; i < buffer.bytes() / sizeof(T); ++i) buffer.as<T>()[i] = normal_value<T>();
}

// Runs one backend operation on the CPU and the emulated GPU into two guarded
// outputs that start out equal.
template <typename Op>
void both(const std::string& what, Guarded& cpu_out, Guarded& gpu_out, Op&& op) {
  auto cpu = make_cpu_kernels(1);
  auto gpu = make_cuda_kernels(nullptr, 10.0);
  ++cases;
  op(*cpu, cpu_out);
  const std::string error = two_schedules(what, {{gpu_out.data(), gpu_out.bytes()}}, [&] { op(*gpu, gpu_out); });
  expect(error.empty(), "%s: %s", what.c_str(), error.c_str());
  expect(gpu_out.guards_intact(), "%s: wrote outside the output", what.c_str());
}

template <typename T>
void data_ops(const Route& r) {
  const a2a_routing_t routing = r.routing();
  const int64_t T_ = r.T, k = r.k;
  int64_t M = pick({0, 1, 7, 8, 9, 1000, 4099, 33, 64});
  if (std::max(T_, r.num_rows) * M > 400000) M = pick({1, 7, 8, 9});  // keep the emulation fast
  const int64_t choices = T_ * k;
  const a2a_dtype_t dtype = dtype_of<T>();
  const size_t e = sizeof(T);
  // Misaligned by whole elements: a scalar head, or rows whose misalignments differ (scalar rows).
  const size_t x_shift = e * static_cast<size_t>(pick({0, 0, 1, 3}));
  const size_t rows_shift = e * static_cast<size_t>(pick({0, 0, 1, 2}));
  const size_t y_shift = e * static_cast<size_t>(pick({0, 0, 1, 5}));
  const Gates<T> gates(choices, static_cast<int>(rng() % 3));
  char what[200];
  std::snprintf(what, sizeof what, "%s %s M=%ld gates=%d shifts=%zu,%zu,%zu capacity=%ld rows=%ld", r.what.c_str(),
                name_of<T>(), M, gates.mode, x_shift / e, rows_shift / e, y_shift / e, r.capacity, r.num_rows);
  const std::string label(what);

  Guarded x(static_cast<size_t>(T_ * M) * e, x_shift), rows(static_cast<size_t>(r.num_rows * M) * e, rows_shift);
  random_fill<T>(x);
  random_fill<T>(rows);
  if (M > 0) {  // moe/moe.cpp calls neither with model_dim 0
    Guarded cpu_rows(rows.bytes(), rows_shift), gpu_rows(rows.bytes(), rows_shift);
    both(label + " dispatch", cpu_rows, gpu_rows, [&](Kernels& kernels, Guarded& out) {
      kernels.dispatch(routing, x.data(), dtype, M, gates.pointer(), gates.dtype(), out.data());
    });
    expect(std::equal(gpu_rows.data(), gpu_rows.data() + gpu_rows.bytes(), cpu_rows.data()),
           "%s dispatch: differs from the CPU", what);

    Guarded cpu_y(x.bytes(), y_shift), gpu_y(x.bytes(), y_shift);
    both(label + " combine", cpu_y, gpu_y, [&](Kernels& kernels, Guarded& out) {
      kernels.combine(routing, rows.data(), dtype, M, gates.pointer(), gates.dtype(), out.data());
    });
    expect(std::equal(gpu_y.data(), gpu_y.data() + gpu_y.bytes(), cpu_y.data()), "%s combine: differs from the CPU",
           what);
  }

  // gate_grad: against the CPU within the bound stated at the top.
  const a2a_dtype_t gate_dtype = rng() % 2 ? dtype : A2A_FLOAT32;
  const size_t gate_size = gate_dtype == A2A_FLOAT32 ? 4 : e;
  Guarded cpu_grad(static_cast<size_t>(choices) * gate_size, 0), gpu_grad(cpu_grad.bytes(), 0);
  both(label + " gate_grad", cpu_grad, gpu_grad, [&](Kernels& kernels, Guarded& out) {
    kernels.gate_grad(routing, x.data(), rows.data(), dtype, M, gate_dtype, out.data());
  });
  const double u = acc_eps<T>(), gamma = (M + 2) * u / (1 - (M + 2) * u);
  // The store's rounding: float32 gates round only float64's accumulator; 16-bit gates round float's.
  const bool wide = std::is_same_v<T, float> || std::is_same_v<T, double>;
  const double u_gate = gate_dtype == A2A_FLOAT32 ? (std::is_same_v<T, double> ? std::ldexp(1.0, -24) : 0.0)
                                                  : (wide ? 0.0 : store_eps<T>());
  const double subnormal = gate_dtype == A2A_FLOAT16 ? std::ldexp(1.0, -25) : 0.0;
  ++checks;
  for (int64_t c = 0; c < choices; ++c) {
    auto value = [&](Guarded& g) {
      return gate_dtype == A2A_FLOAT32 ? static_cast<double>(g.as<float>()[c]) : double(Num<T>::load(g.as<T>()[c]));
    };
    const double a = value(cpu_grad), b = value(gpu_grad);
    const int64_t row = kept_row(routing, c);
    double magnitude = 0;
    for (int64_t i = 0; row >= 0 && i < M; ++i)
      magnitude += std::fabs(double(Num<T>::load(x.as<T>()[c / k * M + i])) *
                             double(Num<T>::load(rows.as<T>()[row * M + i])));
    const double bound = 2 * gamma * magnitude * (1 + u_gate) + u_gate * (std::fabs(a) + std::fabs(b)) + subnormal;
    if (!(std::fabs(a - b) <= bound)) {
      fail("%s gate_grad: choice %ld is %.9g, the CPU's %.9g, beyond the bound %.3g", what, c, b, a, bound);
      break;
    }
  }
}

void route_case(int64_t i) {
  Route r;
  const bool large = i % 9 == 8;  // a few large scans: several tiles, grid-stride loops, two scan chunks
  r.T = large ? pick({3000, 20000, 300000}) : pick({0, 1, 5, 33, 200, 700});
  r.k = i / 4 % 4 == 1 ? pick({9, 10}) : pick({1, 2, 3, 8});  // every dtype meets top_k > 8 (combine's kMany)
  if (r.T >= 20000) r.k = std::min<int64_t>(r.k, 2);
  r.E = large ? pick({2, 5}) : pick({1, 2, 3, 8, 17});
  r.index_dtype = rng() % 2 ? A2A_INT32 : A2A_INT64;
  emu::device = static_cast<int>(below(3));  // 1 to 3 SMs: grids of 16 to 48 blocks
  const int64_t choices = r.T * r.k;
  const double unrouted = pick({0, 1, 3}) / 10.0;
  const int64_t hot = 1 + below(r.E);  // skewed: experts below `hot` get most choices (drops)
  r.indices64.resize(static_cast<size_t>(choices));
  for (int64_t c = 0; c < choices; ++c) {
    int64_t expert = uniform() < 0.7 ? below(hot) : below(r.E);
    if (uniform() < unrouted) expert = pick({-1, -1, -2, INT32_MIN, INT64_MIN});
    r.indices64[c] = expert;
  }
  if (choices > 0 && rng() % 8 == 0)  // an index out of range: route fails naming the first one
    for (int bad = 0; bad < 2; ++bad) r.indices64[below(choices)] = pick({r.E, r.E + 3, INT32_MAX, INT64_MAX});
  r.indices32.resize(r.indices64.size());
  for (size_t c = 0; c < r.indices64.size(); ++c) {
    const int64_t v = r.indices64[c];
    r.indices32[c] = v == INT64_MIN ? INT32_MIN : v == INT64_MAX ? INT32_MAX : static_cast<int32_t>(v);
  }
  if (r.T > 0 && rng() % 3 == 0) {  // batch-prioritized: tokens in a permuted order
    r.order.resize(static_cast<size_t>(r.T));
    std::iota(r.order.begin(), r.order.end(), 0);
    std::shuffle(r.order.begin(), r.order.end(), rng);
    if (rng() % 4 == 0) r.order[below(r.T)] = pick({-1, r.T, INT64_MAX, r.order[below(r.T)]});  // not a permutation
    ++ordered_cases;
  }
  many_cases += r.k > 8;
  char what[160];
  std::snprintf(what, sizeof what, "route T=%ld k=%ld E=%ld %s order=%d sms=%d", r.T, r.k, r.E,
                r.index_dtype == A2A_INT32 ? "int32" : "int64", !r.order.empty(), emu::device_sms[emu::device]);
  r.what = what;
  locate_fixed(r, 1 + below(std::max<int64_t>(1, 2 * r.T * r.k / r.E)));
  locate_fixed(r, A2A_CAPACITY_DROPLESS);
  if (!locate(r)) return;
  layout(r);
  switch (i % 4) {
    case 0: data_ops<float>(r); break;
    case 1: data_ops<half_t>(r); break;
    case 2: data_ops<bfloat16_t>(r); break;
    default: data_ops<double>(r); break;
  }
}

}  // namespace

// The packed tables of more experts than cap_kernel's block has threads: runs
// of several experts a thread (route_case's few experts are one a thread).
// Not under TSan, where the scan over 700 experts takes 20 s; route_case's
// packed tables run the same barriers there.
void packed_carry_case() {
  Route r;
  r.T = 16;
  r.k = 2;
  r.E = 700;
  r.indices64.resize(static_cast<size_t>(r.T * r.k));
  for (int64_t& expert : r.indices64) expert = rng() % 5 == 0 ? -1 : below(r.E);
  r.indices32.assign(r.indices64.begin(), r.indices64.end());
  r.index_dtype = A2A_INT32;
  r.what = "route T=16 k=2 E=700 packed";
  locate_fixed(r, A2A_CAPACITY_DROPLESS);
}

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 16);
  for (int64_t i = 0; i < n; ++i) route_case(i);
#ifndef __SANITIZE_THREAD__
  packed_carry_case();
#endif
  std::printf("route cases failing as they should: %lld; with drops: %lld; per-expert capacities: %lld; "
              "token orders: %lld; top_k > 8: %lld; fixed-capacity routes with a deferred fault: %lld\n",
              route_errors, dropped_cases, per_expert_cases, ordered_cases, many_cases, fixed_faults);
  return summary("moe_cuda");
}
