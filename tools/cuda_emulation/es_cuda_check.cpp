// es_cuda.cu's host functions and kernels, run by the CUDA emulation of
// include/ (see run.py), against float64 references: the slot scatter, ESMM
// (CUDA-core and tensor-core paths, every row and layout mode, bias, gates,
// misaligned rows, outputs prefilled with NaN), ESS and ESTMM, each under two
// schedules (check.hpp). Random cases from a seed:
// `es_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "check.hpp"
#include "cuda/es_cuda.hpp"

using namespace a2a;
using namespace a2a::moe;
using namespace check;

// Sizes are picked from small lists that cross every tile edge: 64-slot
// blocks, 16/32-wide K steps, 64/128-column tiles, 8-element vectors.

// A matrix of T with a one-element offset option (misaligned rows).
template <typename T>
struct Data {
  std::vector<T> storage;
  T* p = nullptr;
  std::vector<double> value;  // the stored values, exactly
  Data(int64_t n, bool shift) : storage(n + 8), value(n) {
    p = storage.data() + (shift ? 1 : 0);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = Num<T>::store(static_cast<typename Num<T>::Acc>(std::normal_distribution<double>(0, 1)(rng)));
      value[i] = Num<T>::load(p[i]);
    }
  }
};

// Per-choice gates: mode 0 none (a gate of 1), 1 float32, 2 the data's T;
// g holds their values exactly.
template <typename T>
struct GateSet {
  int mode;
  Data<T> data;
  std::vector<float> f32;
  std::vector<double> g;
  GateSet(int64_t choices, int m) : mode(m), data(choices, false), f32(choices), g(choices, 1.0) {
    for (int64_t c = 0; c < choices; ++c) {
      f32[c] = static_cast<float>(0.05 + uniform());
      if (mode == 1) g[c] = f32[c];
      if (mode == 2) g[c] = data.value[c];
    }
  }
  EsGates view() const {
    return {mode == 0 ? nullptr : mode == 1 ? static_cast<const void*>(f32.data()) : data.p, mode == 2};
  }
};

struct Index {
  int64_t T, k, E, tile, num_slots;
  std::vector<int64_t> indices, slots, starts, counts;
  a2a_es_index_t view() const { return {T, k, E, tile, num_slots, slots.data(), starts.data(), counts.data()}; }
};

// Builds the index on the host, then checks the kernel's slot scatter against it.
Index make_index(int64_t T, int64_t k, int64_t E, int64_t tile, double unrouted, const EsLaunch& launch) {
  Index ix{T, k, E, tile, 0, std::vector<int64_t>(T * k), {}, std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(E, 0)};
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> perm(E);
    for (int64_t e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j)
      ix.indices[t * k + j] = uniform() < unrouted || j >= E ? -1 - int64_t(rng() % 3) : perm[j];
  }
  std::vector<int64_t> locations(T * k, -1);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t c = t * k + j, e = ix.indices[c];
      if (e >= 0) locations[c] = ix.counts[e]++;
    }
  for (int64_t e = 0; e < E; ++e) ix.starts[e + 1] = ix.starts[e] + (ix.counts[e] + tile - 1) / tile * tile;
  ix.num_slots = ix.starts[E];
  std::vector<int64_t> want(ix.num_slots, -1);
  for (int64_t c = 0; c < T * k; ++c)
    if (ix.indices[c] >= 0) want[ix.starts[ix.indices[c]] + locations[c]] = c;
  ix.slots.assign(ix.num_slots + 1, 12345);  // one guard entry past the end
  RouteProblem problem{ix.indices.data(), A2A_INT64, T, k, E, nullptr};
  char what[100];
  std::snprintf(what, sizeof what, "scatter T=%ld k=%ld E=%ld tile=%ld", T, k, E, tile);
  ++cases;
  two_schedules(what, {{ix.slots.data(), ix.slots.size() * sizeof(int64_t)}}, [&] {
    cuda_es_scatter_slots(launch, problem, locations.data(), ix.starts.data(), ix.num_slots, ix.slots.data());
  });
  bool ok = ix.slots[ix.num_slots] == 12345;
  for (int64_t s = 0; s < ix.num_slots; ++s) ok = ok && ix.slots[s] == want[s];
  expect(ok, "%s", what);
  ix.slots.resize(ix.num_slots);
  return ix;
}

int64_t row_of(a2a_es_rows_t rows, int64_t c, int64_t k) { return rows == A2A_ES_ROWS_TOKEN ? c / k : c; }

template <typename T>
bool compare(const char* what, const T* got, const std::vector<double>& exact, const std::vector<double>& magnitude,
             double terms) {
  ++checks;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double g = Num<T>::load(got[i]);
    // Half the spacing of the dtype's subnormals covers a result that rounds to one.
    const double subnormal = std::is_same_v<T, half_t> ? std::ldexp(1.0, -24) : 0.0;
    const double bound = 2 * (terms + 2) * acc_eps<T>() * magnitude[i] + 2 * store_eps<T>() * std::fabs(exact[i]) +
                         subnormal / 2 + 1e-300;
    if (!(std::fabs(g - exact[i]) <= bound)) {
      fail("%s %s at %zu: got %.9g exact %.9g bound %.3g", what, name_of<T>(), i, g, exact[i], bound);
      return false;
    }
  }
  return true;
}

template <typename T>
void test_esmm(const Index& ix, int64_t K, int64_t N, const EsLaunch& launch, a2a_es_rows_t x_rows,
               a2a_es_rows_t y_rows, a2a_es_weight_layout_t layout, bool with_bias, int gate_mode, bool shift) {
  using Acc = typename Num<T>::Acc;
  const int64_t T_ = ix.T, k = ix.k, choices = T_ * k, E = ix.E;
  const int64_t x_rows_n = x_rows == A2A_ES_ROWS_TOKEN ? T_ : choices;
  Data<T> x(x_rows_n * K, shift), w(E * N * K, shift), b(E * N, false);
  const GateSet<T> gates(choices, gate_mode);
  const std::vector<double>& g = gates.g;
  const int64_t y_rows_n = y_rows == A2A_ES_ROWS_TOKEN ? T_ : choices;
  std::vector<T> y(y_rows_n * N + 1);
  std::memset(y.data(), 0xff, y.size() * sizeof(T));  // NaN everywhere: every row must be written
  const bool ws = y_rows == A2A_ES_ROWS_TOKEN && k > 1;
  std::vector<Acc> workspace(ws ? choices * N : 0);
  if (!workspace.empty()) std::memset(workspace.data(), 0xff, workspace.size() * sizeof(Acc));
  EsMatmul p{{x.p, x_rows, K}, w.p, layout, with_bias ? b.p : nullptr,
             gates.view(),
             dtype_of<T>(), N, y.data(), y_rows, ws ? workspace.data() : nullptr};
  if (y_rows_n == 0 || N == 0) return;  // es_ops.cpp returns early
  char what[200];
  std::snprintf(what, sizeof what, "esmm T=%ld k=%ld E=%ld tile=%ld K=%ld N=%ld x=%d y=%d kn=%d bias=%d gates=%d shift=%d ptx=%d",
                T_, k, E, ix.tile, K, N, x_rows, y_rows, layout, with_bias, gate_mode, shift, emu::ptx_version);
  ++cases;
  two_schedules(what, {{y.data(), y.size() * sizeof(T)}, {workspace.data(), workspace.size() * sizeof(Acc)}},
                [&] { cuda_esmm(launch, ix.view(), p); });
  std::vector<double> exact(y_rows_n * N, 0.0), magnitude(y_rows_n * N, 0.0);
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t e = ix.indices[c];
    if (e < 0) continue;
    const int64_t xr = row_of(x_rows, c, k), yr = y_rows == A2A_ES_ROWS_TOKEN ? c / k : c;
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, m = 0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double wv = layout == A2A_ES_WEIGHT_NK ? w.value[(e * N + n) * K + kk] : w.value[(e * K + kk) * N + n];
        s += wv * x.value[xr * K + kk];
        m += std::fabs(wv * x.value[xr * K + kk]);
      }
      if (with_bias) s += b.value[e * N + n], m += std::fabs(b.value[e * N + n]);
      exact[yr * N + n] += g[c] * s;
      magnitude[yr * N + n] += std::fabs(g[c]) * m;
    }
  }
  compare<T>(what, y.data(), exact, magnitude, K + k);
  expect(std::memcmp(&y[y_rows_n * N], "\xff\xff\xff\xff\xff\xff\xff\xff", sizeof(T)) == 0, "%s: wrote past y",
         what);
}

template <typename T>
void test_ess(const Index& ix, int64_t N, const EsLaunch& launch, a2a_es_rows_t rows, int gate_mode) {
  const int64_t k = ix.k, choices = ix.T * k, E = ix.E;
  Data<T> x((rows == A2A_ES_ROWS_TOKEN ? ix.T : choices) * N, false);
  const GateSet<T> gates(choices, gate_mode);
  const std::vector<double>& g = gates.g;
  std::vector<T> out(E * N + 1);
  std::memset(out.data(), 0xff, out.size() * sizeof(T));
  if (N == 0) return;
  char what[160];
  std::snprintf(what, sizeof what, "ess T=%ld k=%ld E=%ld tile=%ld N=%ld rows=%d gates=%d", ix.T, k, E, ix.tile, N, rows,
                gate_mode);
  ++cases;
  two_schedules(what, {{out.data(), out.size() * sizeof(T)}}, [&] {
    cuda_ess(launch, ix.view(), {x.p, rows, N},
             gates.view(),
             dtype_of<T>(), out.data());
  });
  std::vector<double> exact(E * N, 0.0), magnitude(E * N, 0.0);
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, ix.counts[e]);
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t e = ix.indices[c];
    if (e < 0) continue;
    for (int64_t n = 0; n < N; ++n) {
      const double v = g[c] * x.value[row_of(rows, c, k) * N + n];
      exact[e * N + n] += v;
      magnitude[e * N + n] += std::fabs(v);
    }
  }
  compare<T>(what, out.data(), exact, magnitude, most);
  expect(std::memcmp(&out[E * N], "\xff\xff\xff\xff\xff\xff\xff\xff", sizeof(T)) == 0, "%s: wrote past out",
         what);
}

template <typename T>
void test_estmm(const Index& ix, int64_t A, int64_t B, const EsLaunch& launch, a2a_es_rows_t a_rows,
                a2a_es_rows_t b_rows, int gate_mode) {
  const int64_t k = ix.k, choices = ix.T * k, E = ix.E;
  Data<T> a((a_rows == A2A_ES_ROWS_TOKEN ? ix.T : choices) * A, false);
  Data<T> b((b_rows == A2A_ES_ROWS_TOKEN ? ix.T : choices) * B, false);
  const GateSet<T> gates(choices, gate_mode);
  const std::vector<double>& g = gates.g;
  std::vector<T> out(E * A * B + 1);
  std::memset(out.data(), 0xff, out.size() * sizeof(T));
  if (E * A * B == 0) return;
  char what[160];
  std::snprintf(what, sizeof what, "estmm T=%ld k=%ld E=%ld tile=%ld A=%ld B=%ld rows=%d,%d gates=%d", ix.T, k, E, ix.tile,
                A, B, a_rows, b_rows, gate_mode);
  ++cases;
  two_schedules(what, {{out.data(), out.size() * sizeof(T)}}, [&] {
    cuda_estmm(launch, ix.view(), {a.p, a_rows, A}, {b.p, b_rows, B},
               gates.view(),
               dtype_of<T>(), out.data());
  });
  std::vector<double> exact(E * A * B, 0.0), magnitude(E * A * B, 0.0);
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, ix.counts[e]);
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t e = ix.indices[c];
    if (e < 0) continue;
    for (int64_t i = 0; i < A; ++i)
      for (int64_t j = 0; j < B; ++j) {
        const double v = g[c] * a.value[row_of(a_rows, c, k) * A + i] * b.value[row_of(b_rows, c, k) * B + j];
        exact[(e * A + i) * B + j] += v;
        magnitude[(e * A + i) * B + j] += std::fabs(v);
      }
  }
  compare<T>(what, out.data(), exact, magnitude, most + 1);
  expect(std::memcmp(&out[E * A * B], "\xff\xff\xff\xff\xff\xff\xff\xff", sizeof(T)) == 0, "%s: wrote past out",
         what);
}

template <typename T>
void run_case(int64_t seed_cases) {
  for (int64_t i = 0; i < seed_cases; ++i) {
    const EsLaunch launch{nullptr, int(pick({1, 3, 64}))};
    emu::ptx_version = int(pick({75, 80}));  // the CUDA-core or the tensor-core ESMM for 16-bit floats
    const int64_t T_ = pick({0, 1, 5, 37, 150}), k = pick({1, 2, 3}), E = pick({1, 3, 7});
    const int64_t tile = pick({1, 16, 24, 64, 128});
    const Index ix = make_index(T_, k, E, tile, pick({0, 1, 3}) / 10.0, launch);
    const int64_t K = pick({0, 1, 8, 33, 70, 72}), N = pick({1, 16, 45, 130, 136, 0});
    const auto x_rows = a2a_es_rows_t(rng() % 2), y_rows = a2a_es_rows_t(rng() % 2);
    const auto layout = a2a_es_weight_layout_t(rng() % 2);
    test_esmm<T>(ix, K, N, launch, x_rows, y_rows, layout, rng() % 2, int(rng() % 3), rng() % 4 == 0);
    test_ess<T>(ix, pick({1, 45, 130, 300}), launch, a2a_es_rows_t(rng() % 2), int(rng() % 3));
    test_estmm<T>(ix, pick({1, 17, 70}), pick({1, 20, 66}), launch, a2a_es_rows_t(rng() % 2), a2a_es_rows_t(rng() % 2),
                  int(rng() % 3));
  }
}

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 10);
  run_case<half_t>(n);
  run_case<bfloat16_t>(n);
  run_case<float>(n);
  run_case<double>(n / 2 + 1);
  return summary("es_cuda");
}
