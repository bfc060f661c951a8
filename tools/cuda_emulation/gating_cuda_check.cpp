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
//   - against a float64 reference written here from a2a.h's formulas
//     (softmax; the top k with NaN above every number and ties to the lower
//     expert; gates normalized by max(sum, eps); share; GShard's loss; the
//     backward), within bounds of the rounding of the compute type, and
//     exactly where the definition is exact: the indices are the top k of
//     the kernel's own scores in that order, unnormalized gates are those
//     scores, share and the first-choice counts are counts;
// for float32 and float64; tokens 0, 1, 5, 37 and 300 (above kGateLanes, so
// the column lanes wrap), experts 1, 2, 3, 8, 33 and 64, top_k 1 to min(E, 8),
// normalize on and off; rows of normal logits at scales 1e-3 to 100 (scores
// that underflow to 0: ties at 0), all-equal rows, rows of a few repeated
// values, huge logits, and rows with NaN, +inf and -inf (all-NaN scores).
// The backward runs on the forward's outputs with d_gates and d_l_aux each
// NULL or not, on arbitrary scores (tiny ones included, so that the
// normalization's eps clamp holds), and with an index out of 0..E-1 in one
// row: the CPU throws, the kernel writes that row as NaN and every other row
// as the CPU does with valid indices.
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
template bool a2a::moe::top_k_gate_backward_row<float>(const float*, const int64_t*, const float*, const float*, float,
                                                       int64_t, int64_t, bool, float*);
template bool a2a::moe::top_k_gate_backward_row<double>(const double*, const int64_t*, const double*, const double*,
                                                        double, int64_t, int64_t, bool, double*);
template void a2a::moe::gate_column_lane<float>(const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int,
                                                double*, int64_t*);
template void a2a::moe::gate_column_lane<double>(const double*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                                 int, double*, int64_t*);

namespace {

constexpr int64_t kRowThreads = 128;  // gating_cuda.cu's

// The styles of a row of logits; the last three give NaN scores.
const char* const kStyles[] = {"normal", "equal", "repeated", "integers", "huge", "-inf", "close", "nan", "+inf",
                               "all -inf"};
constexpr int kFiniteStyles = 7;

// Tallies of what the cases covered, printed at the end.
long long forward_cases, backward_cases, bad_index_cases, arbitrary_cases, lanes_wrapped, grid_strided;
long long rows_of[std::size(kStyles)], nan_rows, tied_choices, zero_scores, clamped_rows, nan_payload_differences;
long long reference_rows, reference_backward_rows;

template <typename T>
bool same_value(T a, T b) {
  if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
  return std::isnan(a) && std::isnan(b);
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
    for (int64_t i = 0; i < n; ++i) row[below(E)] = static_cast<T>(v);
  };
  for (int64_t e = 0; e < E; ++e) row[e] = static_cast<T>(scale * normal());
  switch (style) {
    case 1: {  // every logit equal: every score equal
      const T v = static_cast<T>(scale * normal());
      for (int64_t e = 0; e < E; ++e) row[e] = v;
      break;
    }
    case 2: {  // a few values, repeated
      const T values[3] = {static_cast<T>(normal()), static_cast<T>(normal()), static_cast<T>(normal())};
      for (int64_t e = 0; e < E; ++e) row[e] = values[below(3)];
      break;
    }
    case 3:  // small integers: ties, and exact differences
      for (int64_t e = 0; e < E; ++e) row[e] = static_cast<T>(below(5) - 2);
      break;
    case 4: {  // huge magnitudes: differences that overflow to -inf, scores of 0 and 1
      const double big = std::is_same_v<T, float> ? 3e38 : 1e308;
      for (int64_t e = 0; e < E; ++e) row[e] = static_cast<T>(big * (below(3) - 1.0) * (0.5 + uniform() / 2));
      break;
    }
    case 5:  // finite with some -inf: scores of exactly 0
      if (E > 1) some(-inf, E - 1);
      break;
    case 6:  // logits an ulp or two apart: near ties
      for (int64_t e = 0; e < E; ++e) row[e] = static_cast<T>(1 + std::numeric_limits<T>::epsilon() * below(3));
      break;
    case 7:  // NaN
      some(rng() % 2 ? std::nan("") : -std::nan(""), 2);
      break;
    case 8:  // +inf: inf - inf
      some(inf, 2);
      if (rng() % 2) some(-inf, 2);
      break;
    case 9:  // -inf - -inf
      for (int64_t e = 0; e < E; ++e) row[e] = static_cast<T>(-inf);
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
// tolerance covers the kernel's rounding in T: of x - max (relative u, so
// u |x - max| in the exponent), of exp, of the sum (E u) and the division.
template <typename T>
RowReference reference_row(const T* row, int64_t E) {
  RowReference r;
  r.scores.assign(static_cast<size_t>(E), std::nan(""));
  r.tolerance.assign(static_cast<size_t>(E), 0.0);
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t e = 0; e < E; ++e) {
    const double v = static_cast<double>(row[e]);
    if (std::isnan(v)) r.nan = true;
    top = std::max(top, v);
  }
  if (r.nan || std::isinf(top)) {  // NaN, +inf - +inf, -inf - -inf: every score NaN
    r.nan = true;
    return r;
  }
  const double u = store_eps<T>();
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(row[e]) - top);
  for (int64_t e = 0; e < E; ++e) {
    const double d = static_cast<double>(row[e]) - top;
    const size_t i = static_cast<size_t>(e);
    r.scores[i] = std::exp(d) / sum;
    r.tolerance[i] = 4 * static_cast<double>(std::numeric_limits<T>::denorm_min());
    if (r.scores[i] != 0) r.tolerance[i] += 2 * r.scores[i] * u * (std::fabs(d) + 2.0 * static_cast<double>(E) + 8);
  }
  return r;
}

// The k best experts of `scores` by a2a.h's order: NaN above every number,
// then the larger, then the lower expert.
template <typename S>
std::vector<int64_t> ranked(const S* scores, int64_t E, int64_t k) {
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const double x = static_cast<double>(scores[a]), y = static_cast<double>(scores[b]);
    if (std::isnan(x) != std::isnan(y)) return std::isnan(x);
    if (!std::isnan(x) && x != y) return x > y;
    return a < b;
  });
  order.resize(static_cast<size_t>(k));
  return order;
}

template <typename T>
constexpr double eps_of() {
  return static_cast<double>(GateEps<T>::value);
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
  T l_aux = 0;
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
        nan_payload_differences += std::isnan(x) && std::memcmp(&x, &y, sizeof(T)) != 0;
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
        x = static_cast<double>(p), y = static_cast<double>(q);
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

  // Against the float64 reference.
  const double u = store_eps<T>();
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
    // Exact: the indices are the top k of the kernel's scores, in order.
    const std::vector<int64_t> best = ranked(s, E, k);
    for (int64_t j = 0; j < k; ++j) {
      ok &= expect(idx[j] == best[static_cast<size_t>(j)],
                   "%s: row %ld (%s): indices[%ld] = %ld, the top k of the scores give %ld", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(j), static_cast<long>(idx[j]),
                   static_cast<long>(best[static_cast<size_t>(j)]));
      if (!ok) break;
      if (j > 0 && same_value(s[idx[j]], s[idx[j - 1]])) ++tied_choices;
    }
    if (!ok) break;
    for (int64_t e = 0; e < E; ++e) {
      zero_scores += s[e] == T(0);
      column_kernel[static_cast<size_t>(e)] += static_cast<double>(s[e]);
    }
    ++counts[static_cast<size_t>(idx[0])];
    if (!g.normalize)
      for (int64_t j = 0; j < k; ++j)
        ok &= expect(same_value(gt[j], s[idx[j]]), "%s: row %ld (%s): gates[%ld] = %.9g is not its score %.9g",
                     f.what.c_str(), static_cast<long>(t), style, static_cast<long>(j), static_cast<double>(gt[j]),
                     static_cast<double>(s[idx[j]]));
    if (r.nan) {
      for (int64_t e = 0; e < E && ok; ++e)
        ok &= expect(std::isnan(s[e]), "%s: row %ld (%s): scores[%ld] = %.9g, NaN expected", f.what.c_str(),
                     static_cast<long>(t), style, static_cast<long>(e), static_cast<double>(s[e]));
      for (int64_t j = 0; j < k && ok; ++j)
        ok &= expect(idx[j] == j && std::isnan(gt[j]), "%s: row %ld (%s): choice %ld = %ld, gate %.9g; of NaN "
                     "scores the choice is %ld, its gate NaN", f.what.c_str(), static_cast<long>(t), style,
                     static_cast<long>(j), static_cast<long>(idx[j]), static_cast<double>(gt[j]), static_cast<long>(j));
      continue;
    }
    // Within rounding: the scores, the choices' scores, the gates.
    for (int64_t e = 0; e < E && ok; ++e) {
      const size_t i = static_cast<size_t>(e);
      ok &= expect(std::fabs(static_cast<double>(s[e]) - r.scores[i]) <= r.tolerance[i],
                   "%s: row %ld (%s): scores[%ld] = %.17g, the reference %.17g (tolerance %.3g)", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(e), static_cast<double>(s[e]), r.scores[i],
                   r.tolerance[i]);
      column[i] += r.scores[i];
      column_tolerance[i] += r.tolerance[i];
    }
    const std::vector<int64_t> want = ranked(r.scores.data(), E, k);
    double chosen = 0, chosen_relative = 0;
    for (int64_t j = 0; j < k && ok; ++j) {
      const size_t a = static_cast<size_t>(idx[j]), b = static_cast<size_t>(want[static_cast<size_t>(j)]);
      ok &= expect(std::fabs(r.scores[a] - r.scores[b]) <= r.tolerance[a] + r.tolerance[b],
                   "%s: row %ld (%s): choice %ld is expert %ld (reference score %.17g), the reference's is %ld (%.17g)",
                   f.what.c_str(), static_cast<long>(t), style, static_cast<long>(j), static_cast<long>(a),
                   r.scores[a], static_cast<long>(b), r.scores[b]);
      chosen += r.scores[a];
      chosen_relative = std::max(chosen_relative, r.scores[a] > 0 ? r.tolerance[a] / r.scores[a] : 0.0);
    }
    const double denominator = g.normalize ? std::max(chosen, eps_of<T>()) : 1.0;
    clamped_rows += g.normalize && chosen < eps_of<T>();
    for (int64_t j = 0; j < k && ok; ++j) {
      const size_t a = static_cast<size_t>(idx[j]);
      const double want_gate = r.scores[a] / denominator;
      const double tolerance =
          g.normalize
              ? want_gate * (2 * chosen_relative + (static_cast<double>(k) + 4) * u) + r.tolerance[a] / denominator
              : r.tolerance[a];
      ok &= expect(std::fabs(static_cast<double>(gt[j]) - want_gate) <= tolerance,
                   "%s: row %ld (%s): gates[%ld] = %.17g, the reference %.17g (tolerance %.3g)", f.what.c_str(),
                   static_cast<long>(t), style, static_cast<long>(j), static_cast<double>(gt[j]), want_gate, tolerance);
    }
  }
  if (!ok) return false;
  // The columns: first-choice counts and share exactly, sums and the loss within rounding.
  const double tokens = static_cast<double>(T_);
  double loss = 0, loss_tolerance = 0;
  for (int64_t e = 0; e < E; ++e) {
    const size_t i = static_cast<size_t>(e);
    ok &= expect(firsts[e] == counts[i], "%s: expert %ld chosen first %ld times, the workspace says %ld",
                 f.what.c_str(), static_cast<long>(e), static_cast<long>(counts[i]), static_cast<long>(firsts[e]));
    const T want_share = T_ == 0 ? T(0) : static_cast<T>(static_cast<double>(counts[i]) / tokens);
    ok &= expect(same_value(f.share[i], want_share), "%s: share[%ld] = %.17g, %.17g expected", f.what.c_str(),
                 static_cast<long>(e), static_cast<double>(f.share[i]), static_cast<double>(want_share));
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
    }
  }
  if (T_ == 0) {
    ok &= expect(f.l_aux == T(0) && !std::signbit(f.l_aux), "%s: l_aux = %.17g without tokens, 0 expected",
                 f.what.c_str(), static_cast<double>(f.l_aux));
  } else if (any_nan) {
    ok &= expect(std::isnan(f.l_aux), "%s: l_aux = %.17g with NaN scores, NaN expected", f.what.c_str(),
                 static_cast<double>(f.l_aux));
  } else {
    const double E_ = static_cast<double>(E);
    loss *= E_;
    const double tolerance = 2 * E_ * loss_tolerance + loss * (u + (E_ + 8) * std::ldexp(1.0, -52));
    ok &= expect(std::fabs(static_cast<double>(f.l_aux) - loss) <= tolerance,
                 "%s: l_aux = %.17g, the reference %.17g (tolerance %.3g)", f.what.c_str(),
                 static_cast<double>(f.l_aux), loss, tolerance);
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
// kernel's rounding in T; false where the eps clamp is too close to call.
template <typename T>
bool reference_backward_row(const T* s, const int64_t* idx, const T* dg, const T* share, const T* d_l_aux, int64_t E,
                            int64_t k, int64_t tokens, bool normalize, std::vector<double>& d,
                            std::vector<double>& tol) {
  const double u = store_eps<T>();
  std::vector<double> ds(static_cast<size_t>(E)), ds_abs(static_cast<size_t>(E));
  const double scale = d_l_aux == nullptr ? 0.0 : static_cast<double>(*d_l_aux) * static_cast<double>(E) / tokens;
  for (int64_t e = 0; e < E; ++e) {
    ds[static_cast<size_t>(e)] = scale * static_cast<double>(share[e]);
    ds_abs[static_cast<size_t>(e)] = std::fabs(ds[static_cast<size_t>(e)]);
  }
  if (dg != nullptr) {
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += static_cast<double>(s[idx[j]]);
    const double eps = eps_of<T>();
    if (normalize && std::fabs(sum - eps) <= 1e-3 * eps) return false;
    const double denominator = normalize ? std::max(sum, eps) : 1.0;
    double dot = 0, dot_abs = 0;
    if (normalize && sum >= eps)
      for (int64_t j = 0; j < k; ++j) {
        const double gate = static_cast<double>(s[idx[j]]) / denominator;
        dot += static_cast<double>(dg[j]) * gate;
        dot_abs += std::fabs(static_cast<double>(dg[j]) * gate);
      }
    for (int64_t j = 0; j < k; ++j) {
      const size_t e = static_cast<size_t>(idx[j]);
      ds[e] += (static_cast<double>(dg[j]) - dot) / denominator;
      ds_abs[e] += (std::fabs(static_cast<double>(dg[j])) + dot_abs) / denominator;
    }
  }
  double inner = 0, inner_abs = 0;
  for (int64_t e = 0; e < E; ++e) {
    inner += ds[static_cast<size_t>(e)] * static_cast<double>(s[e]);
    inner_abs += ds_abs[static_cast<size_t>(e)] * std::fabs(static_cast<double>(s[e]));
  }
  d.resize(static_cast<size_t>(E));
  tol.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const size_t i = static_cast<size_t>(e);
    const double se = static_cast<double>(s[e]);
    d[i] = se * (ds[i] - inner);
    tol[i] = 2 * u * (2.0 * static_cast<double>(E + k) + 16) * std::fabs(se) * (ds_abs[i] + inner_abs) +
             4 * static_cast<double>(std::numeric_limits<T>::denorm_min());
  }
  return true;
}

// One backward on both backends; `bad_row` >= 0: the indices of that row are
// not experts (and `valid` holds the indices it had).
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
      if (!expect(std::isnan(got[bad_row * E + e]), "%s: d_logits[%ld, %ld] = %.9g with bad indices, NaN expected",
                  what.c_str(), static_cast<long>(bad_row), static_cast<long>(e),
                  static_cast<double>(got[bad_row * E + e])))
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
                  static_cast<long>(i / E), static_cast<long>(i % E), static_cast<double>(got[i]),
                  static_cast<double>(clean[static_cast<size_t>(i)])))
        break;
    }
  } else {
    expect(cpu_error.empty(), "%s: the CPU fails: %s", what.c_str(), cpu_error.c_str());
  }
  // Bitwise against the CPU (which writes every row, a bad one as NaN, before it throws).
  for (int64_t i = 0; i < T_ * E; ++i) {
    nan_payload_differences += std::isnan(got[i]) && std::memcmp(&got[i], &cpu[static_cast<size_t>(i)], sizeof(T)) != 0;
    if (!expect(same_value(got[i], cpu[static_cast<size_t>(i)]), "%s: d_logits[%ld, %ld] = %.17g differs from the "
                "CPU's %.17g", what.c_str(), static_cast<long>(i / E), static_cast<long>(i % E),
                static_cast<double>(got[i]), static_cast<double>(cpu[static_cast<size_t>(i)])))
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
      const double x = static_cast<double>(got[t * E + e]), y = want[static_cast<size_t>(e)];
      const bool ok = std::isnan(x) || std::isnan(y) ? std::isnan(x) && std::isnan(y)
                                                     : std::fabs(x - y) <= tolerance[static_cast<size_t>(e)];
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
void run_case(int64_t tokens, int64_t experts) {
  Forward<T> f;
  a2a_top_k_gate_t& g = f.gate;
  g.num_tokens = tokens;
  g.num_experts = experts;
  g.top_k = 1 + below(std::min<int64_t>(experts, 8));
  g.normalize = static_cast<int>(rng() % 2);
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
  for (int64_t i = 0; i < T_ * k; ++i) d_gates.as<T>()[i] = static_cast<T>(normal());
  *d_l_aux.as<T>() = static_cast<T>(pick({1, 10, 100}) * normal() / 10);
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
  // An index that is not an expert in one row.
  if (T_ > 0) {
    const int64_t row = below(T_), j = below(k);
    const int64_t bad = pick({-1, E, E + 7, INT64_MIN, INT64_MAX});
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

  // Arbitrary scores (not a softmax), some rows tiny enough for the eps clamp,
  // distinct valid indices, arbitrary share.
  {
    ++arbitrary_cases;
    const double tiny = std::is_same_v<T, float> ? 1e-10 : 1e-19;
    for (int64_t t = 0; t < T_; ++t) {
      const bool small = rng() % 3 == 0;
      std::vector<int64_t> experts_of(static_cast<size_t>(E));
      std::iota(experts_of.begin(), experts_of.end(), 0);
      std::shuffle(experts_of.begin(), experts_of.end(), rng);
      for (int64_t e = 0; e < E; ++e) scores.as<T>()[t * E + e] = static_cast<T>(small ? tiny * uniform() : uniform());
      for (int64_t j = 0; j < k; ++j) indices.as<int64_t>()[t * k + j] = experts_of[static_cast<size_t>(j)];
      clamped_rows += g.normalize && small;
    }
    for (int64_t e = 0; e < E; ++e) share.as<T>()[e] = static_cast<T>(uniform());
    const std::vector<int64_t> valid(indices.as<int64_t>(), indices.as<int64_t>() + T_ * k);
    const BackwardInputs in{scores.data(), indices.as<int64_t>(), share.data(), rng() % 4 ? d_gates.data() : nullptr,
                            rng() % 2 ? d_l_aux.data() : nullptr};
    backward_case<T>(g, in, describe<T>("backward", g, max_blocks, threads, " arbitrary scores"), max_blocks,
                     threads, -1, nullptr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 10);
  // Every shape once, then shapes at random.
  const int64_t all_tokens[] = {0, 1, 5, 37, 300}, all_experts[] = {1, 2, 3, 8, 33, 64};
  for (int64_t tokens : all_tokens)
    for (int64_t experts : all_experts) {
      if (rng() % 2)
        run_case<float>(tokens, experts);
      else
        run_case<double>(tokens, experts);
    }
  for (int64_t i = 0; i < n; ++i) {
    run_case<float>(pick({0, 1, 5, 37, 300}), pick({1, 2, 3, 8, 33, 64}));
    run_case<double>(pick({0, 1, 5, 37, 300}), pick({1, 2, 3, 8, 33, 64}));
  }
  std::printf("cases: %lld forward, %lld backward (%lld with a bad index, %lld on arbitrary scores); %lld with the "
              "column lanes wrapping, %lld with grid-stride loops turning\n",
              forward_cases, backward_cases, bad_index_cases, arbitrary_cases, lanes_wrapped, grid_strided);
  std::printf("rows:");
  for (size_t s = 0; s < std::size(kStyles); ++s) std::printf(" %s %lld%s", kStyles[s], rows_of[s],
                                                              s + 1 < std::size(kStyles) ? "," : "\n");
  std::printf("%lld rows of NaN scores, %lld choices tied with the previous, %lld scores of 0, %lld rows with the eps "
              "clamp; %lld forward and %lld backward rows against float64; %lld NaN with other bits than the CPU's\n",
              nan_rows, tied_choices, zero_scores, clamped_rows, reference_rows, reference_backward_rows,
              nan_payload_differences);
  return summary("gating_cuda");
}
