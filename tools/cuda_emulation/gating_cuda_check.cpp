// gating_cuda.cu's host functions and kernels (top_k_gate_rows_kernel,
// top_k_gate_columns_kernel, top_k_gate_loss_kernel,
// top_k_gate_backward_kernel), through cuda_top_k_gate /
// cuda_top_k_gate_backward, run by the CUDA emulation of include/ (see
// run.py):
//   - bitwise against their CPU twins (cpu/gating_cpu.cpp: top_k_gate_cpu /
//     top_k_gate_backward_cpu, on 1 to 4 threads) on the same inputs: scores,
//     indices, gates, share, l_aux, the workspace's per-expert sums and
//     first-choice counts, and d_logits (a NaN equal only to a NaN, whatever
//     its payload);
//   - against a2a.h's definitions, exactly where they are exact: the indices
//     are the top k of the logits as stored, in that order, equal logits by
//     the lower expert (0..k-1 in a row of NaN scores), and the k largest of
//     the kernel's own scores, best first; each gate is its score, or
//     round(score / max(round(the chosen scores' sum), eps)) computed here
//     from the kernel's scores in the compute type (the sum in choice order,
//     rounded to the dtype as gating.hpp documents; a rounding to each dtype
//     written here, not half.hpp's); share is count / tokens stored as
//     gating.hpp's from_double does (through float for 16-bit dtypes), and
//     the first-choice counts are counts;
//   - against a float64 reference written here from a2a.h's formulas
//     (softmax; the top k; gates normalized by max(sum, eps); GShard's loss;
//     the backward), within bounds of the rounding of the compute type and of
//     the stored dtype: the scores within half an ulp of the dtype (16-bit)
//     plus the compute type's error, l_aux within the dtype's rounding of the
//     loss of the kernel's own column sums and of the float64 softmax, each
//     backward row within the compute type's error bound plus one rounding to
//     the dtype of a float64 evaluation on the kernel's own scores (for
//     float16 / bfloat16 with the denominator a2a.h's rounded sum, the same
//     clamp decision as the kernel's; a value beyond the dtype's range is
//     infinity of its sign);
// every shape once in a dtype at random, then random shapes in each of
// float32, float64, float16 and bfloat16 (16-bit dtypes compute in float
// and round the scores, the chosen sum, each gate and each d_logits); tokens
// 0, 1, 5, 37 and 300 (above kGateLanes, so the column lanes wrap), experts
// 1, 2, 3, 8, 33 and 64 (160 too in the first pass; and cases of k = 1 at
// 160 experts in bfloat16 and 1100 in float16: rows of nearly equal logits
// whose chosen sum the forward clamps to eps), top_k 1 to min(E, 8),
// normalize on and off; rows of normal logits at scales 1e-3 to 100 (scores
// that underflow to 0: ties at 0; in 16 bits many ties of unequal logits from
// rounding), all-equal rows, rows of a few repeated values, huge logits (near
// the dtype's largest), logits an ulp of the dtype apart, and rows with NaN,
// +inf and -inf (all-NaN scores).
// The backward runs on the forward's outputs with d_gates and d_l_aux each
// NULL or not, on arbitrary scores (tiny ones, so that the normalization's
// eps clamp holds, and ones whose chosen sum is eps or within a percent of
// it: an ulp or a few in 16 bits), and with an index out of 0..E-1 in one row: the CPU throws, the
// kernel writes that row as NaN and every other row as the CPU does with
// valid indices.
// Each operation runs under two schedules (check.hpp), with grids capped at 1
// to 5 blocks (EsLaunch::max_blocks) so that the grid-stride loops turn.
// Outputs have guard bytes on both sides; inputs must stay as they were.
// `gating_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "check.hpp"
#include "cpu/gating_cpu.hpp"
#include "cuda/gating_cuda.hpp"
#include "moe/gating.hpp"

using namespace check;
using namespace a2a;
using namespace a2a::moe;

// gating.hpp's row functions are not inlined at -O1, so the kernel file and
// cpu/gating_cpu.cpp each emit a copy and the linker keeps one for both. These
// explicit instantiations make it this program's (linked first by run.py,
// compiled as the CPU build is: no FMA contraction, gating.hpp's host branch),
// so that the CPU twin runs the CPU's code rather than the kernel file's.
// Both backends then run the same row arithmetic: what the emulation proves
// there is the kernels' indexing, bounds, races and order; the columns and the
// loss (inlined into the kernels) are the kernel file's own code.
template void a2a::moe::top_k_gate_row<float>(const float*, int64_t, int64_t, bool, float*, int64_t*, float*);
template void a2a::moe::top_k_gate_row<double>(const double*, int64_t, int64_t, bool, double*, int64_t*, double*);
template void a2a::moe::top_k_gate_row<half_t>(const half_t*, int64_t, int64_t, bool, half_t*, int64_t*, half_t*);
template void a2a::moe::top_k_gate_row<bfloat16_t>(const bfloat16_t*, int64_t, int64_t, bool, bfloat16_t*, int64_t*,
                                                   bfloat16_t*);
template bool a2a::moe::top_k_gate_backward_row<float>(const float*, const int64_t*, const float*, const float*, float,
                                                       int64_t, int64_t, bool, float*);
template bool a2a::moe::top_k_gate_backward_row<double>(const double*, const int64_t*, const double*, const double*,
                                                        double, int64_t, int64_t, bool, double*);
template bool a2a::moe::top_k_gate_backward_row<half_t>(const half_t*, const int64_t*, const half_t*, const half_t*,
                                                        float, int64_t, int64_t, bool, half_t*);
template bool a2a::moe::top_k_gate_backward_row<bfloat16_t>(const bfloat16_t*, const int64_t*, const bfloat16_t*,
                                                            const bfloat16_t*, float, int64_t, int64_t, bool,
                                                            bfloat16_t*);
template void a2a::moe::gate_column_lane<float>(const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int,
                                                double*, int64_t*);
template void a2a::moe::gate_column_lane<double>(const double*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                                 int, double*, int64_t*);
template void a2a::moe::gate_column_lane<half_t>(const half_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                                 int, double*, int64_t*);
template void a2a::moe::gate_column_lane<bfloat16_t>(const bfloat16_t*, const int64_t*, int64_t, int64_t, int64_t,
                                                     int64_t, int, double*, int64_t*);

namespace {

constexpr int64_t kRowThreads = 128;  // gating_cuda.cu's

// ---------------------------------------------------------------------------
// The four dtypes: values as double, the format's parameters, and a rounding
// to each written here (round to nearest even on the format's grid, with
// gradual underflow and overflow to infinity), independent of half.hpp.

template <typename T>
using Acc = typename Num<T>::Acc;

// Whether T is its own compute type (float32, float64) or is computed in
// float (float16, bfloat16).
template <typename T>
constexpr bool kSelfComputed = std::is_same_v<T, Acc<T>>;

template <typename T>
double value(T v) {
  return static_cast<double>(Num<T>::load(v));
}
// v as stored in T (through the compute type, as the 16-bit inputs are made).
template <typename T>
T make(double v) {
  return Num<T>::store(static_cast<Acc<T>>(v));
}
template <typename T>
bool is_nan(T v) {
  return std::isnan(value(v));
}
template <typename T>
bool same_value(T a, T b) {
  if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
  return is_nan(a) && is_nan(b);
}

// Significant digits (with the implicit bit), the least normal exponent and
// the largest finite value of each dtype.
template <typename T>
struct Format;
template <>
struct Format<float> {
  static constexpr int digits = 24, min_exponent = -126;
  static constexpr double max = 3.4028234663852886e38;
};
template <>
struct Format<double> {
  static constexpr int digits = 53, min_exponent = -1022;
  static constexpr double max = std::numeric_limits<double>::max();
};
template <>
struct Format<half_t> {
  static constexpr int digits = 11, min_exponent = -14;
  static constexpr double max = 65504;
};
template <>
struct Format<bfloat16_t> {
  static constexpr int digits = 8, min_exponent = -126;
  static constexpr double max = 3.3895313892515355e38;
};
template <typename T>
double epsilon_of() {  // the distance from 1 to the next value
  return std::ldexp(1.0, 1 - Format<T>::digits);
}
template <typename T>
double denorm_of() {  // the least positive value
  return std::ldexp(1.0, Format<T>::min_exponent - Format<T>::digits + 1);
}

// The least magnitude that rounds to infinity in T.
template <typename T>
double overflow_of() {
  return Format<T>::max + std::ldexp(1.0, std::ilogb(Format<T>::max) - Format<T>::digits);
}

// x rounded to T's grid, to nearest even; NaN, infinities and zeros stay.
template <typename T>
double round_to(double x) {
  if (std::is_same_v<T, double> || !std::isfinite(x) || x == 0) return x;
  const int exponent = std::max(std::ilogb(x), Format<T>::min_exponent);
  const double ulp = std::ldexp(1.0, exponent - Format<T>::digits + 1);
  const double r = std::nearbyint(x / ulp) * ulp;  // x / ulp is exact: a power of two
  return std::fabs(r) > Format<T>::max ? std::copysign(std::numeric_limits<double>::infinity(), x) : r;
}

template <typename T>
constexpr double eps_of() {
  return static_cast<double>(GateEps<T>::value);
}

// The styles of a row of logits; the last three give NaN scores.
const char* const kStyles[] = {"normal", "equal", "repeated", "integers", "huge", "-inf", "close", "nan", "+inf",
                               "all -inf"};
constexpr int kFiniteStyles = 7;

// Tallies of what the cases covered, printed at the end.
long long forward_cases, backward_cases, bad_index_cases, arbitrary_cases, lanes_wrapped, grid_strided;
long long rows_of[std::size(kStyles)], nan_rows, tied_choices, ties_kept_apart, zero_scores;
long long forward_clamped_rows, clamped_rows, boundary_rows, exact_gates, overflowed;
long long nan_payload_differences, reference_rows, reference_backward_rows;
long long forward_of[4], backward_of[4];  // by dtype: f32, f64, f16, bf16

template <typename T>
int dtype_index() {
  return std::is_same_v<T, float> ? 0 : std::is_same_v<T, double> ? 1 : std::is_same_v<T, half_t> ? 2 : 3;
}

void random_bytes(Guarded& g) {
  for (size_t i = 0; i < g.bytes(); ++i) g.data()[i] = static_cast<unsigned char>(rng());
}
// memcpy, for empty buffers too (whose vectors may hold NULL).
void copy_bytes(void* to, const void* from, size_t n) {
  if (n != 0) std::memcpy(to, from, n);
}
std::vector<unsigned char> bytes_of(const Guarded& g) { return {g.data(), g.data() + g.bytes()}; }
bool unchanged(const Guarded& g, const std::vector<unsigned char>& before) {
  return std::equal(before.begin(), before.end(), g.data());
}

// A buffer of n values of T at a misalignment of whole elements.
template <typename T>
Guarded buffer(int64_t n) {
  return Guarded(static_cast<size_t>(n) * sizeof(T), sizeof(T) * static_cast<size_t>(below(4)));
}

double normal() { return std::normal_distribution<double>(0, 1)(rng); }

// One row of logits in a style picked at random (normal ones more often;
// NaN scores only when `specials`); returns the style.
template <typename T>
int row_logits(T* row, int64_t E, bool specials) {
  const int64_t styles = specials ? static_cast<int64_t>(std::size(kStyles)) : kFiniteStyles;
  const int style = static_cast<int>(std::max<int64_t>(0, below(styles + 3) - 3));
  const double inf = std::numeric_limits<double>::infinity();
  const double scale = static_cast<double>(pick({1, 10, 1000, 8000, 100000})) / 1000;  // 1e-3 .. 100
  auto some = [&](double v, int64_t most) {  // v at 1 to `most` random places
    const int64_t n = 1 + below(most);
    for (int64_t i = 0; i < n; ++i) row[below(E)] = make<T>(v);
  };
  for (int64_t e = 0; e < E; ++e) row[e] = make<T>(scale * normal());
  switch (style) {
    case 1: {  // every logit equal: every score equal
      const T v = make<T>(scale * normal());
      for (int64_t e = 0; e < E; ++e) row[e] = v;
      break;
    }
    case 2: {  // a few values, repeated
      const T values[3] = {make<T>(normal()), make<T>(normal()), make<T>(normal())};
      for (int64_t e = 0; e < E; ++e) row[e] = values[below(3)];
      break;
    }
    case 3:  // small integers: ties, and exact differences
      for (int64_t e = 0; e < E; ++e) row[e] = make<T>(static_cast<double>(below(5) - 2));
      break;
    case 4: {  // huge magnitudes: differences that overflow to -inf, scores of 0 and 1
      const double big = std::is_same_v<T, double> ? 1e308 : 0.9 * Format<T>::max;
      for (int64_t e = 0; e < E; ++e) row[e] = make<T>(big * (below(3) - 1.0) * (0.5 + uniform() / 2));
      break;
    }
    case 5:  // finite with some -inf: scores of exactly 0
      if (E > 1) some(-inf, E - 1);
      break;
    case 6:  // logits an ulp or two apart: near ties
      for (int64_t e = 0; e < E; ++e) row[e] = make<T>(1 + epsilon_of<T>() * static_cast<double>(below(3)));
      break;
    case 7:  // NaN
      some(rng() % 2 ? std::nan("") : -std::nan(""), 2);
      break;
    case 8:  // +inf: inf - inf
      some(inf, 2);
      if (rng() % 2) some(-inf, 2);
      break;
    case 9:  // -inf - -inf
      for (int64_t e = 0; e < E; ++e) row[e] = make<T>(-inf);
      break;
    default:
      break;
  }
  return style;
}

// ---------------------------------------------------------------------------
// The float64 reference.

struct RowReference {
  std::vector<double> scores, tolerance;  // tolerance: of each of the kernel's scores
  bool nan = false;
};

// softmax(x) in float64 from the row's logits as stored in T; each score's
// tolerance covers the kernel's rounding in the compute type (unit u): of
// x - max (relative u, so u |x - max| in the exponent), of exp, of the sum
// (E u) and the division; then, for a 16-bit T, the score's one rounding to
// T (half an ulp: uT relative, or half of T's least value below its normals).
template <typename T>
RowReference reference_row(const T* row, int64_t E) {
  RowReference r;
  r.scores.assign(static_cast<size_t>(E), std::nan(""));
  r.tolerance.assign(static_cast<size_t>(E), 0.0);
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t e = 0; e < E; ++e) {
    const double v = value(row[e]);
    if (std::isnan(v)) r.nan = true;
    top = std::max(top, v);
  }
  if (r.nan || std::isinf(top)) {  // NaN, +inf - +inf, -inf - -inf: every score NaN
    r.nan = true;
    return r;
  }
  const double u = acc_eps<T>(), uT = store_eps<T>();
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(value(row[e]) - top);
  for (int64_t e = 0; e < E; ++e) {
    const double d = value(row[e]) - top;
    const size_t i = static_cast<size_t>(e);
    r.scores[i] = std::exp(d) / sum;
    double tolerance = 4 * denorm_of<Acc<T>>();
    if (r.scores[i] != 0) tolerance += 2 * r.scores[i] * u * (std::fabs(d) + 2.0 * static_cast<double>(E) + 8);
    if constexpr (!kSelfComputed<T>) tolerance += uT * (r.scores[i] + tolerance) + denorm_of<T>() / 2;
    r.tolerance[i] = tolerance;
  }
  return r;
}

// The k best experts of `scores` (or logits): NaN above every number, then
// the larger, then the lower expert.
template <typename S>
std::vector<int64_t> ranked(const S* scores, int64_t E, int64_t k) {
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const double x = value(scores[a]), y = value(scores[b]);
    if (std::isnan(x) != std::isnan(y)) return std::isnan(x);
    if (!std::isnan(x) && x != y) return x > y;
    return a < b;
  });
  order.resize(static_cast<size_t>(k));
  return order;
}

// The denominator of a row's normalized gates by the definition, from the
// kernel's chosen scores: their sum in the compute type in choice order,
// rounded to T (a no-op for float32 / float64), at least eps (NaN stays).
template <typename T>
double gate_denominator(const T* scores, const int64_t* idx, int64_t k, double* rounded_sum = nullptr) {
  Acc<T> sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += Num<T>::load(scores[idx[j]]);
  const double s = round_to<T>(static_cast<double>(sum));
  if (rounded_sum != nullptr) *rounded_sum = s;
  return s < eps_of<T>() ? eps_of<T>() : s;
}

// ---------------------------------------------------------------------------
// Forward.

template <typename T>
struct Forward {
  a2a_top_k_gate_t gate{};
  std::vector<T> logits;
  std::vector<int> styles;
  // The kernel's outputs (equal to the CPU's when the case passed).
  std::vector<T> scores, gates, share;
  std::vector<int64_t> indices;
  T l_aux{};
  std::vector<RowReference> reference;
  std::string what;
};

template <typename T>
bool forward_case(Forward<T>& f, int max_blocks, int threads) {
  const a2a_top_k_gate_t& g = f.gate;
  const int64_t T_ = g.num_tokens, E = g.num_experts, k = g.top_k;
  Guarded logits = buffer<T>(T_ * E);
  f.styles.resize(static_cast<size_t>(T_));
  const bool specials = rng() % 2 == 0;
  for (int64_t t = 0; t < T_; ++t) {
    f.styles[static_cast<size_t>(t)] = row_logits(logits.as<T>() + t * E, E, specials);
    ++rows_of[f.styles[static_cast<size_t>(t)]];
  }
  f.logits.assign(logits.as<T>(), logits.as<T>() + T_ * E);
  const std::vector<unsigned char> logits_before = bytes_of(logits);

  // The outputs of both backends, from the same random bytes.
  Guarded gpu_scores = buffer<T>(T_ * E), gpu_gates = buffer<T>(T_ * k), gpu_share = buffer<T>(E),
          gpu_l_aux = buffer<T>(1);
  Guarded gpu_indices(static_cast<size_t>(T_ * k) * 8, 8 * static_cast<size_t>(below(4)));
  Guarded gpu_workspace(static_cast<size_t>(E) * 16, 8 * static_cast<size_t>(below(4)));
  Guarded* gpu[] = {&gpu_scores, &gpu_indices, &gpu_gates, &gpu_share, &gpu_l_aux, &gpu_workspace};
  for (Guarded* b : gpu) random_bytes(*b);
  std::vector<std::vector<unsigned char>> cpu(std::size(gpu));
  for (size_t i = 0; i < std::size(gpu); ++i) cpu[i] = bytes_of(*gpu[i]);
  {
    // 8-byte alignment for the CPU's workspace and indices.
    std::vector<int64_t> cpu_indices(static_cast<size_t>(T_ * k));
    std::vector<int64_t> cpu_workspace(static_cast<size_t>(2 * E));
    copy_bytes(cpu_indices.data(), cpu[1].data(), cpu[1].size());
    copy_bytes(cpu_workspace.data(), cpu[5].data(), cpu[5].size());
    top_k_gate_cpu(g, f.logits.data(), cpu[0].data(), cpu_indices.data(), cpu[2].data(), cpu[3].data(), cpu[4].data(),
                   cpu_workspace.data(), threads);
    copy_bytes(cpu[1].data(), cpu_indices.data(), cpu[1].size());
    copy_bytes(cpu[5].data(), cpu_workspace.data(), cpu[5].size());
  }

  const EsLaunch launch{nullptr, max_blocks};
  ++cases;
  ++forward_cases;
  ++forward_of[dtype_index<T>()];
  std::vector<Region> regions;
  for (Guarded* b : gpu) regions.push_back({b->data(), b->bytes()});
  const std::string error = two_schedules(f.what, regions, [&] {
    cuda_top_k_gate(launch, g, logits.data(), gpu_scores.data(), gpu_indices.as<int64_t>(), gpu_gates.data(),
                    gpu_share.data(), gpu_l_aux.data(), gpu_workspace.data());
  });
  bool ok = expect(error.empty(), "%s: %s", f.what.c_str(), error.c_str());

  // Bitwise against the CPU.
  const char* names[] = {"scores", "indices", "gates", "share", "l_aux", "workspace"};
  for (size_t i = 0; i < std::size(gpu); ++i) {
    const unsigned char* a = gpu[i]->data();
    const unsigned char* b = cpu[i].data();
    const size_t n = gpu[i]->bytes();
    bool same = true;
    size_t at = 0;
    if (i == 1 || i == 5) {  // int64 (and the workspace's sums: double)
      for (size_t j = 0; j < n && same; j += 8) {
        const bool sums = i == 5 && static_cast<int64_t>(j / 8) < E;
        if (sums) {
          double x, y;
          std::memcpy(&x, a + j, 8);
          std::memcpy(&y, b + j, 8);
          same = same_value(x, y);
          nan_payload_differences += std::isnan(x) && std::memcmp(&x, &y, 8) != 0;
        } else {
          same = std::memcmp(a + j, b + j, 8) == 0;
        }
        at = j;
      }
    } else {
      for (size_t j = 0; j < n && same; j += sizeof(T)) {
        T x, y;
        std::memcpy(&x, a + j, sizeof(T));
        std::memcpy(&y, b + j, sizeof(T));
        same = same_value(x, y);
        nan_payload_differences += is_nan(x) && std::memcmp(&x, &y, sizeof(T)) != 0;
        at = j;
      }
    }
    if (!same) {
      const size_t element = (i == 1 || i == 5) ? 8 : sizeof(T);
      const size_t index = at / element;
      double x = 0, y = 0;
      if (i == 1 || (i == 5 && static_cast<int64_t>(index) >= E)) {
        int64_t p, q;
        std::memcpy(&p, a + at, 8);
        std::memcpy(&q, b + at, 8);
        x = static_cast<double>(p), y = static_cast<double>(q);
      } else if (i == 5) {
        std::memcpy(&x, a + at, 8);
        std::memcpy(&y, b + at, 8);
      } else {
        T p, q;
        std::memcpy(&p, a + at, sizeof(T));
        std::memcpy(&q, b + at, sizeof(T));
        x = value(p), y = value(q);
      }
      const int64_t row = i == 0                ? static_cast<int64_t>(index) / E
                          : (i == 1 || i == 2) ? static_cast<int64_t>(index) / k
                                               : -1;
      char where[80] = "";
      if (row >= 0)
        std::snprintf(where, sizeof where, " (row %ld, %s)", static_cast<long>(row),
                      kStyles[f.styles[static_cast<size_t>(row)]]);
      else if (i == 5)
        std::snprintf(where, sizeof where, " (the %s of expert %ld)", static_cast<int64_t>(index) < E ? "sum" : "count",
                      static_cast<long>(static_cast<int64_t>(index) % E));
      ok = expect(false, "%s: %s[%zu] = %.17g differs from the CPU's %.17g%s", f.what.c_str(), names[i], index, x, y,
                  where);
    } else {
      ++checks;
    }
    ok &= expect(gpu[i]->guards_intact(), "%s: wrote outside %s", f.what.c_str(), names[i]);
  }
  ok &= expect(unchanged(logits, logits_before), "%s: changed the logits", f.what.c_str());

  f.scores.assign(gpu_scores.as<T>(), gpu_scores.as<T>() + T_ * E);
  f.gates.assign(gpu_gates.as<T>(), gpu_gates.as<T>() + T_ * k);
  f.share.assign(gpu_share.as<T>(), gpu_share.as<T>() + E);
  f.indices.assign(gpu_indices.as<int64_t>(), gpu_indices.as<int64_t>() + T_ * k);
  f.l_aux = *gpu_l_aux.as<T>();
  const double* sums = gpu_workspace.as<double>();
  const int64_t* firsts = reinterpret_cast<const int64_t*>(sums + E);

  lanes_wrapped += T_ > kGateLanes;
  grid_strided += T_ > kRowThreads * max_blocks || E > max_blocks;

  // Against the definitions and the float64 reference.
  const double u = store_eps<T>(), uA = acc_eps<T>();
  f.reference.clear();
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  std::vector<double> column(static_cast<size_t>(E), 0), column_tolerance(static_cast<size_t>(E), 0),
      column_kernel(static_cast<size_t>(E), 0);
  bool any_nan = false;
  for (int64_t t = 0; t < T_ && ok; ++t) {
    const T* s = f.scores.data() + t * E;
    const int64_t* idx = f.indices.data() + t * k;
    const T* gt = f.gates.data() + t * k;
    f.reference.push_back(reference_row(f.logits.data() + t * E, E));
    const RowReference& r = f.reference.back();
    const char* style = kStyles[f.styles[static_cast<size_t>(t)]];
    ++reference_rows;
    any_nan |= r.nan;
    nan_rows += r.nan;
    // Exact: the indices are the top k of the logits (as stored), in order,
    // equal logits by the lower expert; 0..k-1 in a row of NaN scores.
    const T* x = f.logits.data() + t * E;
    std::vector<int64_t> best(static_cast<size_t>(k));
    if (r.nan)
      std::iota(best.begin(), best.end(), 0);
    else
      best = ranked(x, E, k);
    for (int64_t j = 0; j < k; ++j) {
      ok &= expect(idx[j] == best[static_cast<size_t>(j)],
                   "%s: row %ld (%s): indices[%ld] = %ld, the top k of the logits give %ld", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(j), static_cast<long>(idx[j]),
                   static_cast<long>(best[static_cast<size_t>(j)]));
      if (!ok) break;
      if (j > 0 && same_value(s[idx[j]], s[idx[j - 1]])) {
        ++tied_choices;
        ties_kept_apart += !r.nan && value(x[idx[j]]) != value(x[idx[j - 1]]);
      }
    }
    if (!ok) break;
    // Exact: they are the k largest of the kernel's scores, best first (the
    // softmax and the rounding to T keep the logits' order).
    if (!r.nan) {
      std::vector<bool> chosen_expert(static_cast<size_t>(E), false);
      for (int64_t j = 0; j < k; ++j) chosen_expert[static_cast<size_t>(idx[j])] = true;
      for (int64_t j = 1; j < k && ok; ++j)
        ok &= expect(value(s[idx[j]]) <= value(s[idx[j - 1]]),
                     "%s: row %ld (%s): choice %ld's score %.17g is above choice %ld's %.17g", f.what.c_str(),
                     static_cast<long>(t), style, static_cast<long>(j), value(s[idx[j]]), static_cast<long>(j - 1),
                     value(s[idx[j - 1]]));
      for (int64_t e = 0; e < E && ok; ++e)
        ok &= expect(chosen_expert[static_cast<size_t>(e)] || value(s[e]) <= value(s[idx[k - 1]]),
                     "%s: row %ld (%s): expert %ld, not chosen, has the score %.17g, above the last choice's %.17g",
                     f.what.c_str(), static_cast<long>(t), style, static_cast<long>(e), value(s[e]),
                     value(s[idx[k - 1]]));
      if (!ok) break;
    }
    for (int64_t e = 0; e < E; ++e) {
      zero_scores += value(s[e]) == 0;
      column_kernel[static_cast<size_t>(e)] += value(s[e]);
    }
    ++counts[static_cast<size_t>(idx[0])];
    // Exact: each gate is its score, or round(score / max(round(sum), eps)) in the compute type.
    double rounded_sum = 0;
    const double denominator = gate_denominator(s, idx, k, &rounded_sum);
    boundary_rows += g.normalize && rounded_sum == eps_of<T>();
    for (int64_t j = 0; j < k && ok; ++j) {
      const T want = g.normalize ? make<T>(round_to<T>(static_cast<double>(
                                       Num<T>::load(s[idx[j]]) / static_cast<Acc<T>>(denominator))))
                                 : s[idx[j]];
      ok &= expect(same_value(gt[j], want),
                   "%s: row %ld (%s): gates[%ld] = %.9g, its score %.9g %s %.9g (the chosen sum rounded %.9g)",
                   f.what.c_str(), static_cast<long>(t), style, static_cast<long>(j), value(gt[j]), value(s[idx[j]]),
                   g.normalize ? "gives" : "is", value(want), rounded_sum);
      ++exact_gates;
    }
    if (r.nan) {
      for (int64_t e = 0; e < E && ok; ++e)
        ok &= expect(is_nan(s[e]), "%s: row %ld (%s): scores[%ld] = %.9g, NaN expected", f.what.c_str(),
                     static_cast<long>(t), style, static_cast<long>(e), value(s[e]));
      for (int64_t j = 0; j < k && ok; ++j)
        ok &= expect(idx[j] == j && is_nan(gt[j]), "%s: row %ld (%s): choice %ld = %ld, gate %.9g; of NaN "
                     "scores the choice is %ld, its gate NaN", f.what.c_str(), static_cast<long>(t), style,
                     static_cast<long>(j), static_cast<long>(idx[j]), value(gt[j]), static_cast<long>(j));
      continue;
    }
    // Within rounding: the scores, the choices' scores, the gates.
    for (int64_t e = 0; e < E && ok; ++e) {
      const size_t i = static_cast<size_t>(e);
      ok &= expect(std::fabs(value(s[e]) - r.scores[i]) <= r.tolerance[i],
                   "%s: row %ld (%s): scores[%ld] = %.17g, the reference %.17g (tolerance %.3g)", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(e), value(s[e]), r.scores[i], r.tolerance[i]);
      column[i] += r.scores[i];
      column_tolerance[i] += r.tolerance[i];
    }
    const std::vector<int64_t> want = ranked(r.scores.data(), E, k);
    double chosen = 0, chosen_tolerance = 0;
    for (int64_t j = 0; j < k && ok; ++j) {
      const size_t a = static_cast<size_t>(idx[j]), b = static_cast<size_t>(want[static_cast<size_t>(j)]);
      ok &= expect(std::fabs(r.scores[a] - r.scores[b]) <= r.tolerance[a] + r.tolerance[b],
                   "%s: row %ld (%s): choice %ld is expert %ld (reference score %.17g), the reference's is %ld (%.17g)",
                   f.what.c_str(), static_cast<long>(t), style, static_cast<long>(j), static_cast<long>(a),
                   r.scores[a], static_cast<long>(b), r.scores[b]);
      chosen += r.scores[a];
      chosen_tolerance += r.tolerance[a];
    }
    const double reference_denominator = g.normalize ? std::max(chosen, eps_of<T>()) : 1.0;
    forward_clamped_rows += g.normalize && chosen < eps_of<T>();
    for (int64_t j = 0; j < k && ok; ++j) {
      const size_t a = static_cast<size_t>(idx[j]);
      const double want_gate = r.scores[a] / reference_denominator;
      // The scores' tolerances (of the numerator, and of the sum: relative to
      // the denominator, which is at least the sum), the sum's k additions
      // (and its rounding to T), the division and the gate's rounding to T.
      const double tolerance = g.normalize ? want_gate * (2 * chosen_tolerance / reference_denominator +
                                                          (static_cast<double>(k) + 4) * uA +
                                                          (kSelfComputed<T> ? 0.0 : 2 * u)) +
                                                 r.tolerance[a] / reference_denominator + denorm_of<T>()
                                           : r.tolerance[a];
      ok &= expect(std::fabs(value(gt[j]) - want_gate) <= tolerance,
                   "%s: row %ld (%s): gates[%ld] = %.17g, the reference %.17g (tolerance %.3g)", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(j), value(gt[j]), want_gate, tolerance);
    }
  }
  if (!ok) return false;
  // The columns: first-choice counts and share exactly, sums and the loss within rounding.
  const double tokens = static_cast<double>(T_);
  double loss = 0, loss_tolerance = 0, kernel_loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    const size_t i = static_cast<size_t>(e);
    ok &= expect(firsts[e] == counts[i], "%s: expert %ld chosen first %ld times, the workspace says %ld",
                 f.what.c_str(), static_cast<long>(e), static_cast<long>(counts[i]), static_cast<long>(firsts[e]));
    // count / tokens in float64, stored as T through the compute type (gating.hpp's from_double).
    const double fraction = T_ == 0 ? 0.0 : static_cast<double>(counts[i]) / tokens;
    const T want_share = make<T>(round_to<T>(static_cast<double>(static_cast<Acc<T>>(fraction))));
    ok &= expect(same_value(f.share[i], want_share), "%s: share[%ld] = %.17g, %.17g expected", f.what.c_str(),
                 static_cast<long>(e), value(f.share[i]), value(want_share));
    // The workspace's sum is of the kernel's scores, in float64 (in any order: within T u64 of the sum).
    const double u64 = std::ldexp(1.0, -53);
    const double sum_tolerance = (tokens + 2) * u64 * column_kernel[i];
    ok &= expect(any_nan ? std::isnan(sums[e]) || std::isnan(column_kernel[i])
                         : std::fabs(sums[e] - column_kernel[i]) <= sum_tolerance,
                 "%s: the workspace's sum of expert %ld is %.17g, its scores add to %.17g", f.what.c_str(),
                 static_cast<long>(e), sums[e], column_kernel[i]);
    if (!any_nan && T_ > 0) {
      loss += (column[i] / tokens) * (static_cast<double>(counts[i]) / tokens);
      loss_tolerance += ((column_tolerance[i] + sum_tolerance) / tokens) * (static_cast<double>(counts[i]) / tokens);
      kernel_loss += (column_kernel[i] / tokens) * (static_cast<double>(counts[i]) / tokens);
    }
  }
  const double l_aux = value(f.l_aux);
  if (T_ == 0) {
    ok &= expect(l_aux == 0 && !std::signbit(l_aux), "%s: l_aux = %.17g without tokens, 0 expected", f.what.c_str(),
                 l_aux);
  } else if (any_nan) {
    ok &= expect(std::isnan(l_aux), "%s: l_aux = %.17g with NaN scores, NaN expected", f.what.c_str(), l_aux);
  } else {
    const double E_ = static_cast<double>(E);
    // The loss in float64 of the kernel's own scores: l_aux is it rounded to
    // T (through the compute type), up to float64's rounding of the sums.
    kernel_loss *= E_;
    const double rounding =
        kernel_loss * ((kSelfComputed<T> ? 0.0 : u) + uA + (E_ + tokens + 8) * std::ldexp(1.0, -52)) +
        denorm_of<T>() / 2;
    ok &= expect(std::fabs(l_aux - kernel_loss) <= rounding,
                 "%s: l_aux = %.17g, the loss of its scores %.17g (tolerance %.3g)", f.what.c_str(), l_aux, kernel_loss,
                 rounding);
    // And of the float64 softmax.
    loss *= E_;
    const double tolerance = 2 * E_ * loss_tolerance + rounding + loss * (E_ + 8) * std::ldexp(1.0, -52);
    ok &= expect(std::fabs(l_aux - loss) <= tolerance, "%s: l_aux = %.17g, the reference %.17g (tolerance %.3g)",
                 f.what.c_str(), l_aux, loss, tolerance);
  }
  return ok;
}

// ---------------------------------------------------------------------------
// Backward.

struct BackwardInputs {
  const void* scores;
  const int64_t* indices;
  const void* share;
  const void* d_gates;  // may be NULL
  const void* d_l_aux;  // may be NULL
};

// d_logits of the float64 formulas of a2a.h for one row, with a bound of the
// kernel's rounding in the compute type and, for a 16-bit T, of its one
// rounding of each d_logits to T; false where the eps clamp is too close to
// call (float32 / float64, whose sum here is float64's; a 16-bit T's is the
// kernel's by definition: rounded to T, so the clamp is decided exactly).
template <typename T>
bool reference_backward_row(const T* s, const int64_t* idx, const T* dg, const T* share, const T* d_l_aux, int64_t E,
                            int64_t k, int64_t tokens, bool normalize, std::vector<double>& d,
                            std::vector<double>& tol) {
  const double u = acc_eps<T>(), uT = store_eps<T>();
  std::vector<double> ds(static_cast<size_t>(E)), ds_abs(static_cast<size_t>(E));
  const double scale =
      d_l_aux == nullptr ? 0.0 : value(*d_l_aux) * static_cast<double>(E) / static_cast<double>(tokens);
  for (int64_t e = 0; e < E; ++e) {
    ds[static_cast<size_t>(e)] = scale * value(share[e]);
    ds_abs[static_cast<size_t>(e)] = std::fabs(ds[static_cast<size_t>(e)]);
  }
  if (dg != nullptr) {
    const double eps = eps_of<T>();
    double sum = 0;
    if constexpr (kSelfComputed<T>) {
      for (int64_t j = 0; j < k; ++j) sum += value(s[idx[j]]);
      if (normalize && std::fabs(sum - eps) <= 1e-3 * eps) return false;
    } else {
      gate_denominator(s, idx, k, &sum);
    }
    const double denominator = normalize ? std::max(sum, eps) : 1.0;
    double dot = 0, dot_abs = 0;
    if (normalize && sum >= eps)
      for (int64_t j = 0; j < k; ++j) {
        const double gate = value(s[idx[j]]) / denominator;
        dot += value(dg[j]) * gate;
        dot_abs += std::fabs(value(dg[j]) * gate);
      }
    for (int64_t j = 0; j < k; ++j) {
      const size_t e = static_cast<size_t>(idx[j]);
      ds[e] += (value(dg[j]) - dot) / denominator;
      ds_abs[e] += (std::fabs(value(dg[j])) + dot_abs) / denominator;
    }
  }
  double inner = 0, inner_abs = 0;
  for (int64_t e = 0; e < E; ++e) {
    inner += ds[static_cast<size_t>(e)] * value(s[e]);
    inner_abs += ds_abs[static_cast<size_t>(e)] * std::fabs(value(s[e]));
  }
  d.resize(static_cast<size_t>(E));
  tol.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const size_t i = static_cast<size_t>(e);
    const double se = value(s[e]);
    d[i] = se * (ds[i] - inner);
    double bound = 2 * u * (2.0 * static_cast<double>(E + k) + 16) * std::fabs(se) * (ds_abs[i] + inner_abs) +
                   static_cast<double>(E + k + 4) * denorm_of<Acc<T>>();
    if constexpr (!kSelfComputed<T>) bound += uT * (std::fabs(d[i]) + bound) + denorm_of<T>() / 2;
    tol[i] = bound;
  }
  return true;
}

// One backward on both backends; `bad_row` >= 0: the indices of that row are
// not k distinct experts (and `valid` holds the indices it had).
template <typename T>
void backward_case(const a2a_top_k_gate_t& g, const BackwardInputs& in, const std::string& what, int max_blocks,
                   int threads, int64_t bad_row, const int64_t* valid) {
  const int64_t T_ = g.num_tokens, E = g.num_experts, k = g.top_k;
  Guarded gpu = buffer<T>(T_ * E);
  random_bytes(gpu);
  std::vector<T> cpu(static_cast<size_t>(T_ * E));
  copy_bytes(cpu.data(), gpu.data(), gpu.bytes());
  const EsLaunch launch{nullptr, max_blocks};
  ++cases;
  ++backward_cases;
  ++backward_of[dtype_index<T>()];
  const std::string error = two_schedules(what, {{gpu.data(), gpu.bytes()}}, [&] {
    cuda_top_k_gate_backward(launch, g, in.scores, in.indices, in.share, in.d_gates, in.d_l_aux, gpu.data());
  });
  expect(error.empty(), "%s: %s", what.c_str(), error.c_str());
  std::string cpu_error;
  a2a_status_t cpu_status = A2A_SUCCESS;
  try {
    top_k_gate_backward_cpu(g, in.scores, in.indices, in.share, in.d_gates, in.d_l_aux, cpu.data(), threads);
  } catch (const Failure& failure) {
    cpu_error = failure.what();
    cpu_status = failure.status();
  }
  expect(gpu.guards_intact(), "%s: wrote outside d_logits", what.c_str());
  const T* got = gpu.as<T>();
  if (bad_row >= 0) {
    ++bad_index_cases;
    const std::string token = "token " + std::to_string(bad_row) + " ";
    expect(cpu_status == A2A_ERROR_INVALID_ARGUMENT && cpu_error.find(token) != std::string::npos,
           "%s: the CPU's error for bad indices in row %ld is '%s' (status %d)", what.c_str(),
           static_cast<long>(bad_row), cpu_error.c_str(), static_cast<int>(cpu_status));
    for (int64_t e = 0; e < E; ++e)
      if (!expect(is_nan(got[bad_row * E + e]), "%s: d_logits[%ld, %ld] = %.9g with bad indices, NaN expected",
                  what.c_str(), static_cast<long>(bad_row), static_cast<long>(e), value(got[bad_row * E + e])))
        break;
    // Every other row as the CPU gives it with valid indices.
    std::vector<T> clean(static_cast<size_t>(T_ * E));
    try {
      top_k_gate_backward_cpu(g, in.scores, valid, in.share, in.d_gates, in.d_l_aux, clean.data(), threads);
    } catch (const Failure& failure) {
      expect(false, "%s: the CPU fails with valid indices: %s", what.c_str(), failure.what());
    }
    for (int64_t i = 0; i < T_ * E; ++i) {
      if (i / E == bad_row) continue;
      if (!expect(same_value(got[i], clean[static_cast<size_t>(i)]),
                  "%s: d_logits[%ld, %ld] = %.17g differs from the CPU's with valid indices %.17g", what.c_str(),
                  static_cast<long>(i / E), static_cast<long>(i % E), value(got[i]),
                  value(clean[static_cast<size_t>(i)])))
        break;
    }
  } else {
    expect(cpu_error.empty(), "%s: the CPU fails: %s", what.c_str(), cpu_error.c_str());
  }
  // Bitwise against the CPU (which writes every row, a bad one as NaN, before it throws).
  for (int64_t i = 0; i < T_ * E; ++i) {
    nan_payload_differences += is_nan(got[i]) && std::memcmp(&got[i], &cpu[static_cast<size_t>(i)], sizeof(T)) != 0;
    if (!expect(same_value(got[i], cpu[static_cast<size_t>(i)]), "%s: d_logits[%ld, %ld] = %.17g differs from the "
                "CPU's %.17g", what.c_str(), static_cast<long>(i / E), static_cast<long>(i % E), value(got[i]),
                value(cpu[static_cast<size_t>(i)])))
      return;
  }
  // Against the float64 formulas.
  std::vector<double> want, tolerance;
  const T* d_gates = static_cast<const T*>(in.d_gates);
  for (int64_t t = 0; t < T_; ++t) {
    if (t == bad_row) continue;
    if (!reference_backward_row(static_cast<const T*>(in.scores) + t * E, in.indices + t * k,
                                d_gates == nullptr ? nullptr : d_gates + t * k, static_cast<const T*>(in.share),
                                static_cast<const T*>(in.d_l_aux), E, k, T_, g.normalize != 0, want, tolerance))
      continue;
    ++reference_backward_rows;
    for (int64_t e = 0; e < E; ++e) {
      const double x = value(got[t * E + e]), y = want[static_cast<size_t>(e)];
      const double bound = tolerance[static_cast<size_t>(e)];
      // Beyond T's range (arbitrary scores, a denominator of eps): infinity.
      const bool overflow = std::isinf(x) && !std::isinf(y) && std::signbit(x) == std::signbit(y) &&
                            std::fabs(y) + bound >= overflow_of<T>();
      const bool ok = std::isnan(x) || std::isnan(y) ? std::isnan(x) && std::isnan(y)
                                                     : overflow || std::fabs(x - y) <= bound;
      overflowed += overflow;
      if (!expect(ok, "%s: d_logits[%ld, %ld] = %.17g, the reference %.17g (tolerance %.3g)", what.c_str(),
                  static_cast<long>(t), static_cast<long>(e), x, y, tolerance[static_cast<size_t>(e)]))
        return;
    }
  }
}

template <typename T>
std::string describe(const char* op, const a2a_top_k_gate_t& g, int max_blocks, int threads, const char* extra = "") {
  char text[240];
  std::snprintf(text, sizeof text, "%s %s tokens=%ld experts=%ld k=%ld normalize=%d max_blocks=%d threads=%d%s", op,
                name_of<T>(), static_cast<long>(g.num_tokens), static_cast<long>(g.num_experts),
                static_cast<long>(g.top_k), g.normalize, max_blocks, threads, extra);
  return text;
}

template <typename T>
void run_case(int64_t tokens, int64_t experts, int64_t top_k = 0, int normalize = -1) {
  Forward<T> f;
  a2a_top_k_gate_t& g = f.gate;
  g.num_tokens = tokens;
  g.num_experts = experts;
  g.top_k = top_k > 0 ? top_k : 1 + below(std::min<int64_t>(experts, 8));
  g.normalize = normalize >= 0 ? normalize : static_cast<int>(rng() % 2);
  g.dtype = dtype_of<T>();
  const int max_blocks = static_cast<int>(pick({1, 2, 3, 5}));
  const int threads = static_cast<int>(pick({1, 2, 4}));
  f.what = describe<T>("forward", g, max_blocks, threads);
  if (!forward_case(f, max_blocks, threads)) return;

  const int64_t T_ = tokens, E = experts, k = g.top_k;
  // The backward's inputs, as device buffers with guards.
  Guarded scores = buffer<T>(T_ * E), share = buffer<T>(E), d_gates = buffer<T>(T_ * k), d_l_aux = buffer<T>(1);
  Guarded indices(static_cast<size_t>(T_ * k) * 8, 8 * static_cast<size_t>(below(4)));
  std::copy(f.scores.begin(), f.scores.end(), scores.as<T>());
  std::copy(f.share.begin(), f.share.end(), share.as<T>());
  std::copy(f.indices.begin(), f.indices.end(), indices.as<int64_t>());
  for (int64_t i = 0; i < T_ * k; ++i) d_gates.as<T>()[i] = make<T>(normal());
  *d_l_aux.as<T>() = make<T>(static_cast<double>(pick({1, 10, 100})) * normal() / 10);
  Guarded* inputs[] = {&scores, &share, &d_gates, &d_l_aux, &indices};
  std::vector<std::vector<unsigned char>> before;
  for (Guarded* b : inputs) before.push_back(bytes_of(*b));

  // d_gates and d_l_aux, each NULL or not.
  for (int which = 0; which < 4; ++which) {
    const BackwardInputs in{scores.data(), indices.as<int64_t>(), share.data(), which & 1 ? d_gates.data() : nullptr,
                            which & 2 ? d_l_aux.data() : nullptr};
    backward_case<T>(g, in, describe<T>("backward", g, max_blocks, threads, which == 0 ? " d_gates=d_l_aux=NULL"
                                                                     : which == 1 ? " d_l_aux=NULL"
                                                                     : which == 2 ? " d_gates=NULL" : ""),
                     max_blocks, threads, -1, nullptr);
  }
  // An index that is not an expert in one row, or (k > 1) an expert chosen twice.
  if (T_ > 0) {
    const int64_t row = below(T_), j = below(k);
    const int64_t* chosen = indices.as<int64_t>() + row * k;
    const int64_t bad = k > 1 && rng() % 3 == 0 ? chosen[(j + 1) % k] : pick({-1, E, E + 7, INT64_MIN, INT64_MAX});
    indices.as<int64_t>()[row * k + j] = bad;
    char extra[80];
    std::snprintf(extra, sizeof extra, " indices[%ld, %ld]=%ld", static_cast<long>(row), static_cast<long>(j),
                  static_cast<long>(bad));
    const BackwardInputs in{scores.data(), indices.as<int64_t>(), share.data(), rng() % 4 ? d_gates.data() : nullptr,
                            rng() % 2 ? d_l_aux.data() : nullptr};
    backward_case<T>(g, in, describe<T>("backward", g, max_blocks, threads, extra), max_blocks, threads, row,
                     f.indices.data());
    indices.as<int64_t>()[row * k + j] = f.indices[static_cast<size_t>(row * k + j)];
  }
  for (size_t i = 0; i < std::size(inputs); ++i)
    expect(unchanged(*inputs[i], before[i]), "%s: the backward changed an input (%zu)", f.what.c_str(), i);

  // Arbitrary scores (not a softmax), distinct valid indices, arbitrary
  // share; some rows tiny enough for the eps clamp (their k chosen scores
  // add to less than eps), some with the chosen scores adding to eps, or
  // within a percent of it (an ulp or a few in 16 bits).
  {
    ++arbitrary_cases;
    const double eps = eps_of<T>();
    const double tiny = eps / 10;  // k <= 8
    for (int64_t t = 0; t < T_; ++t) {
      const int kind = static_cast<int>(rng() % 6);  // 0: tiny, 1: at eps, 2..5: uniform
      std::vector<int64_t> experts_of(static_cast<size_t>(E));
      std::iota(experts_of.begin(), experts_of.end(), 0);
      std::shuffle(experts_of.begin(), experts_of.end(), rng);
      for (int64_t e = 0; e < E; ++e) scores.as<T>()[t * E + e] = make<T>(kind == 0 ? tiny * uniform() : uniform());
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = experts_of[static_cast<size_t>(j)];
        indices.as<int64_t>()[t * k + j] = e;
        if (kind == 1)  // eps / k each (exact for k a power of two), or within a percent
          scores.as<T>()[t * E + e] =
              make<T>(eps / static_cast<double>(k) * (rng() % 2 ? 1.0 : 1 + (uniform() - 0.5) / 50));
      }
      clamped_rows += g.normalize && kind == 0;
    }
    for (int64_t e = 0; e < E; ++e) share.as<T>()[e] = make<T>(uniform());
    const BackwardInputs in{scores.data(), indices.as<int64_t>(), share.data(), rng() % 4 ? d_gates.data() : nullptr,
                            rng() % 2 ? d_l_aux.data() : nullptr};
    if (g.normalize && in.d_gates != nullptr)
      for (int64_t t = 0; t < T_; ++t) {
        double rounded_sum = 0;
        gate_denominator(scores.as<T>() + t * E, indices.as<int64_t>() + t * k, k, &rounded_sum);
        boundary_rows += rounded_sum == eps;
      }
    backward_case<T>(g, in, describe<T>("backward", g, max_blocks, threads, " arbitrary scores"), max_blocks,
                     threads, -1, nullptr);
  }
}

void run_case_of(int type, int64_t tokens, int64_t experts) {
  switch (type) {
    case 0: return run_case<float>(tokens, experts);
    case 1: return run_case<double>(tokens, experts);
    case 2: return run_case<half_t>(tokens, experts);
    default: return run_case<bfloat16_t>(tokens, experts);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 10);
  // Every shape once (in a dtype at random), then shapes at random in every dtype.
  const int64_t all_tokens[] = {0, 1, 5, 37, 300}, all_experts[] = {1, 2, 3, 8, 33, 64, 160};
  for (int64_t tokens : all_tokens)
    for (int64_t experts : all_experts) run_case_of(static_cast<int>(rng() % 4), tokens, experts);
  // The forward's eps clamp: the best score of a row of nearly equal logits
  // is about 1/E, under bfloat16's eps (2^-7) for E = 160 and under
  // float16's (2^-10) for E = 1100; with k = 1 that is the chosen sum.
  run_case<bfloat16_t>(37, 160, 1, 1);
  run_case<half_t>(5, 1100, 1, 1);
  for (int64_t i = 0; i < n; ++i)
    for (int type = 0; type < 4; ++type) run_case_of(type, pick({0, 1, 5, 37, 300}), pick({1, 2, 3, 8, 33, 64}));
  std::printf("cases: %lld forward (f32 %lld, f64 %lld, f16 %lld, bf16 %lld), %lld backward (f32 %lld, f64 %lld, "
              "f16 %lld, bf16 %lld; %lld with a bad index, %lld on arbitrary scores); %lld with the column lanes "
              "wrapping, %lld with grid-stride loops turning\n",
              forward_cases, forward_of[0], forward_of[1], forward_of[2], forward_of[3], backward_cases,
              backward_of[0], backward_of[1], backward_of[2], backward_of[3], bad_index_cases, arbitrary_cases,
              lanes_wrapped, grid_strided);
  std::printf("rows:");
  for (size_t s = 0; s < std::size(kStyles); ++s) std::printf(" %s %lld%s", kStyles[s], rows_of[s],
                                                              s + 1 < std::size(kStyles) ? "," : "\n");
  std::printf("%lld rows of NaN scores, %lld choices tied with the previous (%lld of unequal logits), %lld scores of "
              "0, %lld forward and %lld backward rows with the eps clamp, %lld with the rounded sum at eps; %lld "
              "gates exact\n",
              nan_rows, tied_choices, ties_kept_apart, zero_scores, forward_clamped_rows, clamped_rows, boundary_rows,
              exact_gates);
  std::printf("%lld forward and %lld backward rows against float64 (%lld d_logits beyond the dtype's range); %lld NaN "
              "with other bits than the CPU's\n",
              reference_rows, reference_backward_rows, overflowed, nan_payload_differences);
  return summary("gating_cuda");
}
