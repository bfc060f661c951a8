// fp8_cuda.cu's host functions and kernels (quantize_fp8_kernel,
// dequantize_fp8_kernel), through cuda_quantize_fp8 / cuda_dequantize_fp8,
// run by the CUDA emulation of include/ (see run.py), bitwise against their
// CPU twins (cpu/fp8_cpu.cpp: quantize_fp8_cpu / dequantize_fp8_cpu) on the
// same inputs:
//   - both formats (e4m3fn, e5m2) and the four dtypes (float32, float64,
//     float16, bfloat16) in and out; cols 0, 1, 7, 31, 33, 128, 200, 1000,
//     blocks of 1, 32, 128 and 100 channels (a shorter last block), rows 0,
//     1, 5, 37; codes and scales in separate arrays (q_stride = cols,
//     scale_stride = the block count) or packed rows (a2a_fp8_packed_layout:
//     codes, zeros to 16 bytes, scales at scale_offset, row_bytes in all),
//     whose padding the kernels must leave alone;
//   - quantize: blocks of zeros (+0 and -0), of normal values at random
//     magnitudes, of exact ties between two codes after scaling (subnormal
//     codes included), of NaN, infinities and the extremes of the dtype, of
//     a huge amax over tiny values (subnormal codes, underflow), and of tiny
//     magnitudes only; float64 inputs beyond float's range. Codes and padding
//     bytewise, scales by their bits (a NaN equal only to a NaN);
//   - dequantize: random codes (all 256 byte values, NaN codes included) and
//     scales that are random, zero, -0, infinite, NaN, subnormal or
//     negative; every output element by its bits (a NaN equal only to a NaN);
// each under two schedules (check.hpp), with grids capped at 1 to 5 blocks
// (EsLaunch::max_blocks) so that the grid-stride loops turn. Outputs have
// guard bytes on both sides; inputs must stay as they were.
// Once per run, the element logic of moe/fp8.hpp itself, exhaustively over
// the 256 codes of each format: decode against a float64 formula, decode
// monotonic over the positive codes and odd in the sign, encode(decode(c)) ==
// c for every finite code (+0 and -0 included; infinity saturates to the
// largest finite code, NaN to the NaN code 0x7f); and encode against a
// brute-force round-to-nearest-even over the codes on every code's
// neighbourhood, a strided sweep of all float bit patterns and the specials.
// `fp8_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "check.hpp"
#include "cpu/fp8_cpu.hpp"
#include "cuda/fp8_cuda.hpp"
#include "moe/fp8.hpp"

using namespace check;
using namespace a2a;
using namespace a2a::moe;

namespace {

// Tallies of what the cases covered, printed at the end.
long long packed_cases, separate_cases, short_blocks, grid_strided, zero_blocks, infinite_scales, tiny_amax_blocks;
long long nan_codes, saturated_codes, subnormal_codes, nan_outputs, nan_payload_differences;
long long vector_blocks, vector_rows;  // (row, block) pairs quantized in units, rows dequantized in vectors
long long code_seen[256];

constexpr int64_t kWarpsPerBlock = 256 / 32;  // kThreads / kWarp of fp8_cuda.cu
constexpr int64_t kThreadsPerBlock = 256;

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// fp8_cuda.cu's rules for its wide paths, to tell which ran: quantize's units
// of 4 elements, dequantize's vectors of 16 codes and its threads per row.
template <typename T>
bool quantized_in_units(const T* src, const unsigned char* q, int64_t n) {
  return n >= 4 && aligned(src, std::min<size_t>(16, 4 * sizeof(T))) && aligned(q, 4);
}
template <typename T>
bool dequantized_in_vectors(const unsigned char* q, const T* y, int64_t cols, int64_t block) {
  return cols >= 16 && block % 16 == 0 && aligned(q, 16) && aligned(y, 16);
}
int64_t dequantize_lanes(int64_t cols) {
  int64_t lanes = 1;
  while (lanes < 32 && lanes * 16 < cols) lanes *= 2;
  return lanes;
}

const char* format_name(a2a_fp8_format_t format) { return format == A2A_FP8_E5M2 ? "e5m2" : "e4m3"; }

// The element logic of either format, picked at run time.
float decode(a2a_fp8_format_t format, uint8_t code) {
  return format == A2A_FP8_E5M2 ? E5m2::decode(code) : E4m3::decode(code);
}
uint8_t encode(a2a_fp8_format_t format, float f) {
  return format == A2A_FP8_E5M2 ? E5m2::encode(f) : E4m3::encode(f);
}
uint8_t max_code(a2a_fp8_format_t format) {
  return static_cast<uint8_t>(format == A2A_FP8_E5M2 ? E5m2::kMaxCode : E4m3::kMaxCode);
}

uint32_t bits_of(float f) { return float_bits(f); }

// Two values of T are the same: the same bits, or both NaN.
template <typename T>
bool same_value(T a, T b) {
  if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
  return std::isnan(static_cast<double>(Num<T>::load(a))) && std::isnan(static_cast<double>(Num<T>::load(b)));
}

// A double as stored in T (through float for the 16-bit types).
template <typename T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return Num<T>::store(static_cast<typename Num<T>::Acc>(v));
}

// ---------------------------------------------------------------------------
// The element logic, exhaustively.

// What a code means, from the format's definition in float64.
double reference_decode(a2a_fp8_format_t format, uint8_t code) {
  const int mantissa_bits = format == A2A_FP8_E5M2 ? 2 : 3, bias = format == A2A_FP8_E5M2 ? 15 : 7;
  const int exponent = (code & 0x7f) >> mantissa_bits, mantissa = code & ((1 << mantissa_bits) - 1);
  const int top = 0x7f >> mantissa_bits;
  const double sign = code & 0x80 ? -1.0 : 1.0;
  if (format == A2A_FP8_E4M3 && (code & 0x7f) == 0x7f) return std::nan("");
  if (format == A2A_FP8_E5M2 && exponent == top)
    return mantissa == 0 ? sign * std::numeric_limits<double>::infinity() : std::nan("");
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mantissa, -mantissa_bits), exponent - bias);
}

// Round to nearest even over the finite codes, saturating; NaN to 0x7f, whatever its sign.
uint8_t reference_encode(a2a_fp8_format_t format, float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  const uint8_t top = max_code(format);
  static double table[2][128];  // the positive codes' values, once
  double* value = table[format == A2A_FP8_E5M2];
  if (value[1] == 0.0)
    for (int c = 0; c < 128; ++c) value[c] = reference_decode(format, static_cast<uint8_t>(c));
  if (a >= value[top]) return sign | top;
  uint8_t c = 0;
  while (value[c + 1] <= a) ++c;
  const double lo = value[c], hi = value[c + 1];
  const uint8_t up = static_cast<uint8_t>(c + 1);
  const uint8_t nearest = a - lo < hi - a ? c : a - lo > hi - a ? up : c % 2 == 0 ? c : up;  // ties to even
  return sign | nearest;
}

void element_logic(a2a_fp8_format_t format) {
  const char* name = format_name(format);
  ++cases;
  const uint8_t top = max_code(format);
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float d = decode(format, code);
    const double want = reference_decode(format, code);
    if (std::isnan(want)) {
      expect(std::isnan(d) && !std::signbit(d), "%s decode(%#x) = %.9g, a positive NaN expected", name, c, d);
      const uint8_t back = encode(format, d);
      expect(back == 0x7f, "%s encode(decode(%#x) = NaN) = %#x, the NaN code 0x7f expected", name, c, back);
      continue;
    }
    expect(static_cast<double>(d) == want && std::signbit(d) == std::signbit(want),
           "%s decode(%#x) = %.9g, %.9g expected", name, c, d, want);
    const uint8_t back = encode(format, d);
    if (std::isinf(want))  // e5m2's infinities: encode saturates
      expect(back == ((code & 0x80) | top), "%s encode(decode(%#x) = %g) = %#x, saturated %#x expected", name, c, d,
             back, (code & 0x80) | top);
    else
      expect(back == code, "%s encode(decode(%#x) = %.9g) = %#x", name, c, d, back);
    // Odd in the sign: the negative code is the positive one with the sign bit.
    const float neg = decode(format, static_cast<uint8_t>(code | 0x80));
    expect(bits_of(neg) == (bits_of(decode(format, static_cast<uint8_t>(code & 0x7f))) | 0x80000000u),
           "%s decode(%#x) is not -decode(%#x)", name, code | 0x80, code & 0x7f);
  }
  // Monotonic over the positive codes that are numbers (e5m2's infinity included).
  int last = 0;
  for (int c = 1; c < 128 && !std::isnan(decode(format, static_cast<uint8_t>(c))); ++c) {
    expect(decode(format, static_cast<uint8_t>(c - 1)) < decode(format, static_cast<uint8_t>(c)),
           "%s decode is not increasing at %#x", name, c);
    last = c;
  }
  expect(last == (format == A2A_FP8_E5M2 ? 0x7c : 0x7e), "%s: the positive codes are numbers up to %#x", name, last);
  expect(decode(format, top) == fp8_max(format), "%s: decode(max code) %g != fp8_max %g", name, decode(format, top),
         fp8_max(format));

  // encode against the brute force: every code's neighbourhood (its value,
  // the midpoints to the next code, one float on either side), a sweep of
  // all float bit patterns, and the specials.
  std::vector<float> probes = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(), std::nanf(""), -std::nanf(""),
                               std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(), 1.0f, 464.0f, 465.0f, 61440.0f, 61441.0f};
  for (int c = 0; c + 1 < 128; ++c) {
    const double lo = reference_decode(format, static_cast<uint8_t>(c)),
                 hi = reference_decode(format, static_cast<uint8_t>(c + 1));
    if (std::isnan(lo) || std::isnan(hi)) continue;
    const float points[] = {static_cast<float>(lo), static_cast<float>(std::isinf(hi) ? 2 * lo : (lo + hi) / 2)};
    for (float p : points)
      for (float q : {p, std::nextafter(p, 0.0f), std::nextafter(p, std::numeric_limits<float>::infinity())}) {
        probes.push_back(q);
        probes.push_back(-q);
      }
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521) probes.push_back(bits_float(static_cast<uint32_t>(u)));
  long long wrong = 0;
  for (float f : probes) {
    const uint8_t got = encode(format, f), want = reference_encode(format, f);
    ++checks;
    if (got != want && ++wrong <= 5) fail("%s encode(%.9g = %#x) = %#x, %#x expected", name, f, bits_of(f), got, want);
  }
  failures += wrong > 5 ? wrong - 5 : 0;
}

// ---------------------------------------------------------------------------
// The kernels against the CPU.

// Where one case's codes and scales live: separate arrays, or packed rows.
struct Layout {
  int64_t rows, cols, block, blocks;
  a2a_fp8_format_t format;
  bool packed;
  int64_t scale_offset = 0, row_bytes = 0;  // packed
  size_t q_shift, s_shift;                  // misalignments

  Layout(int64_t r, int64_t c, int64_t b, a2a_fp8_format_t f, bool p)
      : rows(r), cols(c), block(b), blocks(fp8_blocks(c, b)), format(f), packed(p) {
    if (packed) {
      scale_offset = round_up_16(cols);
      row_bytes = scale_offset + round_up_16(4 * blocks);
    }
    // Scales are 4-byte aligned (fp8_ops.cpp requires it); codes of their own may start anywhere.
    q_shift = packed ? 4 * static_cast<size_t>(below(4)) : static_cast<size_t>(below(16));
    s_shift = 4 * static_cast<size_t>(below(4));
  }
  size_t q_bytes() const { return static_cast<size_t>(rows * (packed ? row_bytes : cols)); }
  size_t s_bytes() const { return packed ? 0 : static_cast<size_t>(rows * blocks * 4); }
  a2a_fp8_rows_t view(Guarded& q, Guarded& s) const {
    unsigned char* base = q.data();
    if (packed)
      return {rows, cols, block, format, base, row_bytes, reinterpret_cast<float*>(base + scale_offset),
              row_bytes / 4};
    return {rows, cols, block, format, base, cols, s.as<float>(), blocks};
  }
  // Byte i of the q buffer is the first byte of a scale.
  bool scale_at(size_t i) const {
    if (!packed) return false;
    const int64_t in_row = static_cast<int64_t>(i) % row_bytes;
    return in_row >= scale_offset && in_row < scale_offset + 4 * blocks && (in_row - scale_offset) % 4 == 0;
  }
  std::string what(const char* op, const char* dtype, int max_blocks) const {
    char text[200];
    std::snprintf(text, sizeof text, "%s %s %s rows=%ld cols=%ld block=%ld %s q+%zu s+%zu max_blocks=%d", op,
                  format_name(format), dtype, rows, cols, block, packed ? "packed" : "separate", q_shift,
                  packed ? q_shift : s_shift, max_blocks);
    return text;
  }
};

void random_bytes(Guarded& g) {
  for (size_t i = 0; i < g.bytes(); ++i) g.data()[i] = static_cast<unsigned char>(rng());
}

// The q buffers (codes, padding and, packed, scales) of the two backends:
// bytes, but scales by their values.
bool same_codes(const Layout& l, const Guarded& gpu, const Guarded& cpu, size_t* at) {
  for (size_t i = 0; i < gpu.bytes(); ++i) {
    if (l.scale_at(i)) {
      float a, b;
      std::memcpy(&a, gpu.data() + i, 4);
      std::memcpy(&b, cpu.data() + i, 4);
      if (!same_value(a, b)) return *at = i, false;
      i += 3;
    } else if (gpu.data()[i] != cpu.data()[i]) {
      return *at = i, false;
    }
  }
  return true;
}
bool same_scales(const Guarded& gpu, const Guarded& cpu, size_t* at) {
  for (size_t i = 0; i + 4 <= gpu.bytes(); i += 4) {
    float a, b;
    std::memcpy(&a, gpu.data() + i, 4);
    std::memcpy(&b, cpu.data() + i, 4);
    if (!same_value(a, b)) return *at = i, false;
  }
  return true;
}

// One block's inputs, as doubles (stored in T afterwards): a style at random.
template <typename T>
void block_values(double* v, int64_t n, a2a_fp8_format_t format) {
  // Binary exponents that T holds as normal numbers (float64: beyond float's too).
  const int lo = std::is_same_v<T, half_t> ? -14 : std::is_same_v<T, double> ? -160 : -126;
  const int hi = std::is_same_v<T, half_t> ? 15 : std::is_same_v<T, double> ? 140 : 127;
  auto normal = [] { return std::normal_distribution<double>(0, 1)(rng); };
  auto exponent = [&](int a, int b) { return static_cast<int>(a + below(b - a + 1)); };
  const double inf = std::numeric_limits<double>::infinity();
  const double max_value = fp8_max(format);
  switch (rng() % 8) {
    case 0:  // zeros, of either sign
      for (int64_t i = 0; i < n; ++i) v[i] = rng() % 2 ? 0.0 : -0.0;
      break;
    case 1:
    case 2: {  // normal values at one magnitude
      const int e = exponent(lo + 4, hi - 4);
      for (int64_t i = 0; i < n; ++i) v[i] = std::ldexp(normal(), e);
      break;
    }
    case 3: {  // ties: amax = MAX * 2^k, so the multiplier is 2^-k and each
               // other value lands on the midpoint of two codes (or on a code)
      const int k = std::is_same_v<T, half_t> ? exponent(-8, format == A2A_FP8_E5M2 ? 0 : 6) : exponent(-60, 60);
      const uint8_t top = max_code(format);
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t c = static_cast<uint8_t>(below(top));
        const double a = reference_decode(format, c), b = reference_decode(format, static_cast<uint8_t>(c + 1));
        const double x = rng() % 4 == 0 ? a : (a + b) / 2;
        v[i] = std::ldexp(rng() % 2 ? x : -x, k);
      }
      if (n > 0) v[below(n)] = std::ldexp(rng() % 2 ? max_value : -max_value, k);
      break;
    }
    case 4: {  // specials among normal values
      const double specials[] = {std::nan(""), -std::nan(""), inf, -inf, 0.0, -0.0,
                                 static_cast<double>(std::numeric_limits<float>::max()),
                                 static_cast<double>(std::numeric_limits<float>::denorm_min()),
                                 std::ldexp(1.0, hi), std::ldexp(1.0, lo - 10), 65504.0, 1e300, -1e-300};
      const int e = exponent(-10, 10);
      for (int64_t i = 0; i < n; ++i)
        v[i] = rng() % 3 == 0 ? specials[below(std::size(specials))] : std::ldexp(normal(), e);
      break;
    }
    case 5:
      if (rng() % 2) {  // NaN only, or NaN and zeros: amax 0
        for (int64_t i = 0; i < n; ++i) v[i] = rng() % 2 ? std::nan("") : 0.0;
        break;
      }
      [[fallthrough]];
    case 6: {  // one huge value over tiny ones: subnormal codes and underflow to 0
      const int e = exponent(std::min(hi - 1, lo + 30), hi - 1);
      for (int64_t i = 0; i < n; ++i) v[i] = std::ldexp(normal(), e - static_cast<int>(below(30)));
      if (n > 0) v[below(n)] = std::ldexp(rng() % 2 ? 1.5 : -1.0, e);
      break;
    }
    default: {  // tiny magnitudes only (the smallest of T, subnormals of float)
      const int e = std::is_same_v<T, half_t> ? exponent(-24, -14) : exponent(-149, -120);
      for (int64_t i = 0; i < n; ++i) v[i] = std::ldexp(rng() % 3 == 0 ? 1.0 : normal(), e);
      break;
    }
  }
}

template <typename T>
void quantize_case(a2a_fp8_format_t format, const Layout& l, int max_blocks) {
  const int64_t elements = l.rows * l.cols;
  Guarded x(static_cast<size_t>(elements) * sizeof(T), sizeof(T) * static_cast<size_t>(below(4)));
  std::vector<double> values(static_cast<size_t>(l.cols));
  for (int64_t r = 0; r < l.rows; ++r) {
    for (int64_t b = 0; b < l.blocks; ++b) {
      const int64_t begin = b * l.block, n = std::min(l.block, l.cols - begin);
      block_values<T>(values.data() + begin, n, format);
    }
    for (int64_t c = 0; c < l.cols; ++c) x.as<T>()[r * l.cols + c] = from_double<T>(values[static_cast<size_t>(c)]);
  }
  const std::vector<unsigned char> before(x.data(), x.data() + x.bytes());
  Guarded gpu_q(l.q_bytes(), l.q_shift), cpu_q(l.q_bytes(), l.q_shift);
  Guarded gpu_s(l.s_bytes(), l.s_shift), cpu_s(l.s_bytes(), l.s_shift);
  random_bytes(gpu_q);
  random_bytes(gpu_s);
  std::copy(gpu_q.data(), gpu_q.data() + gpu_q.bytes(), cpu_q.data());
  std::copy(gpu_s.data(), gpu_s.data() + gpu_s.bytes(), cpu_s.data());
  const std::string what = l.what("quantize", name_of<T>(), max_blocks);
  const EsLaunch launch{nullptr, max_blocks};
  const a2a_fp8_rows_t gpu_rows = l.view(gpu_q, gpu_s), cpu_rows = l.view(cpu_q, cpu_s);
  ++cases;
  const std::string error =
      two_schedules(what, {{gpu_q.data(), gpu_q.bytes()}, {gpu_s.data(), gpu_s.bytes()}},
                    [&] { cuda_quantize_fp8(launch, x.data(), dtype_of<T>(), gpu_rows); });
  quantize_fp8_cpu(x.data(), dtype_of<T>(), cpu_rows, 1);
  expect(error.empty(), "%s: %s", what.c_str(), error.c_str());
  size_t at = 0;
  if (!same_codes(l, gpu_q, cpu_q, &at)) {
    expect(false, "%s: q byte %zu differs from the CPU (%#x, the CPU's %#x)", what.c_str(), at, gpu_q.data()[at],
           cpu_q.data()[at]);
    return;
  }
  if (!expect(same_scales(gpu_s, cpu_s, &at), "%s: scale %zu differs from the CPU", what.c_str(), at / 4)) return;
  expect(gpu_q.guards_intact() && gpu_s.guards_intact(), "%s: wrote outside q or the scales", what.c_str());
  expect(std::equal(before.begin(), before.end(), x.data()), "%s: changed x", what.c_str());

  (l.packed ? packed_cases : separate_cases) += 1;
  short_blocks += l.cols % l.block != 0;
  grid_strided += l.rows * l.blocks > kWarpsPerBlock * max_blocks;
  for (int64_t r = 0; r < l.rows; ++r)
    for (int64_t b = 0; b < l.blocks; ++b)
      vector_blocks += quantized_in_units(x.as<T>() + r * l.cols + b * l.block,
                                          static_cast<const unsigned char*>(gpu_rows.q) + r * gpu_rows.q_stride +
                                              b * l.block,
                                          std::min(l.block, l.cols - b * l.block));
  for (int64_t r = 0; r < l.rows; ++r) {
    const T* row = x.as<T>() + r * l.cols;
    for (int64_t b = 0; b < l.blocks; ++b) {
      float amax = 0.0f;
      for (int64_t c = b * l.block; c < std::min(l.cols, (b + 1) * l.block); ++c)
        amax = fold_amax(amax, static_cast<float>(Num<T>::load(row[c])));
      const BlockScale scale = block_scale(amax, fp8_max(format));
      zero_blocks += amax == 0.0f;
      infinite_scales += std::isinf(scale.scale);
      tiny_amax_blocks += std::isinf(scale.multiplier);
    }
    const unsigned char* codes = static_cast<const unsigned char*>(cpu_rows.q) + r * cpu_rows.q_stride;
    for (int64_t c = 0; c < l.cols; ++c) {
      const uint8_t code = codes[c];
      ++code_seen[code];
      const float d = decode(format, code);
      nan_codes += std::isnan(d);
      saturated_codes += (code & 0x7f) == max_code(format);
      subnormal_codes += d != 0.0f && std::fabs(d) < std::ldexp(1.0f, format == A2A_FP8_E5M2 ? -14 : -6);
    }
  }
}

template <typename T>
void dequantize_case(a2a_fp8_format_t format, const Layout& l, int max_blocks) {
  const int64_t elements = l.rows * l.cols;
  Guarded q(l.q_bytes(), l.q_shift), s(l.s_bytes(), l.s_shift);
  random_bytes(q);
  const a2a_fp8_rows_t rows = l.view(q, s);
  if (rng() % 4 == 0)  // every byte value in turn
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t c = 0; c < l.cols; ++c)
        static_cast<unsigned char*>(rows.q)[r * rows.q_stride + c] = static_cast<unsigned char>(r * l.cols + c);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < l.rows; ++r)
    for (int64_t b = 0; b < l.blocks; ++b) {
      const float specials[] = {0.0f, -0.0f, inf, -inf, std::nanf(""), std::numeric_limits<float>::denorm_min(),
                                std::numeric_limits<float>::max(), 1.0f, -2.5f, 1.0f / 448, 1.0f / 57344};
      rows.scales[r * rows.scale_stride + b] =
          rng() % 3 == 0 ? specials[below(std::size(specials))]
                         : static_cast<float>(std::ldexp(0.5 + uniform(), static_cast<int>(below(280)) - 150));
    }
  const std::vector<unsigned char> q_before(q.data(), q.data() + q.bytes()), s_before(s.data(), s.data() + s.bytes());
  const size_t y_shift = sizeof(T) * static_cast<size_t>(below(4));
  Guarded gpu_y(static_cast<size_t>(elements) * sizeof(T), y_shift), cpu_y(gpu_y.bytes(), y_shift);
  const std::string what = l.what("dequantize", name_of<T>(), max_blocks);
  const EsLaunch launch{nullptr, max_blocks};
  ++cases;
  const std::string error = two_schedules(what, {{gpu_y.data(), gpu_y.bytes()}},
                                          [&] { cuda_dequantize_fp8(launch, rows, dtype_of<T>(), gpu_y.data()); });
  dequantize_fp8_cpu(rows, dtype_of<T>(), cpu_y.data(), 1);
  expect(error.empty(), "%s: %s", what.c_str(), error.c_str());
  const T* got = gpu_y.as<T>();
  const T* want = cpu_y.as<T>();
  ++checks;
  for (int64_t i = 0; i < elements; ++i) {
    if (!same_value(got[i], want[i])) {
      const int64_t r = i / l.cols, c = i % l.cols;
      fail("%s: y[%ld, %ld] = %.9g differs from the CPU's %.9g (code %#x, scale %.9g)", what.c_str(), r, c,
           static_cast<double>(Num<T>::load(got[i])), static_cast<double>(Num<T>::load(want[i])),
           static_cast<const unsigned char*>(rows.q)[r * rows.q_stride + c],
           rows.scales[r * rows.scale_stride + c / l.block]);
      break;
    }
    const bool nan = std::isnan(static_cast<double>(Num<T>::load(want[i])));
    nan_outputs += nan;
    nan_payload_differences += nan && std::memcmp(&got[i], &want[i], sizeof(T)) != 0;
  }
  expect(gpu_y.guards_intact(), "%s: wrote outside y", what.c_str());
  grid_strided += l.rows > kThreadsPerBlock / dequantize_lanes(l.cols) * max_blocks;
  for (int64_t r = 0; r < l.rows; ++r)
    vector_rows += dequantized_in_vectors(static_cast<const unsigned char*>(rows.q) + r * rows.q_stride,
                                          gpu_y.as<T>() + r * l.cols, l.cols, l.block);
  expect(std::equal(q_before.begin(), q_before.end(), q.data()) &&
             std::equal(s_before.begin(), s_before.end(), s.data()),
         "%s: changed q or the scales", what.c_str());
}

template <typename T>
void run_cases(a2a_fp8_format_t format) {
  const int64_t rows = pick({0, 1, 5, 37});
  const int64_t cols = pick({0, 1, 7, 31, 33, 128, 200, 1000}), block = pick({1, 32, 128, 100});
  const int max_blocks = static_cast<int>(pick({1, 2, 3, 5}));
  quantize_case<T>(format, Layout(rows, cols, block, format, rng() % 2 == 0), max_blocks);
  dequantize_case<T>(format, Layout(rows, cols, block, format, rng() % 2 == 0), max_blocks);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 10);
  element_logic(A2A_FP8_E4M3);
  element_logic(A2A_FP8_E5M2);
  for (int64_t i = 0; i < n; ++i)
    for (a2a_fp8_format_t format : {A2A_FP8_E4M3, A2A_FP8_E5M2}) {
      run_cases<float>(format);
      run_cases<double>(format);
      run_cases<half_t>(format);
      run_cases<bfloat16_t>(format);
    }
  long long distinct = 0;
  for (long long seen : code_seen) distinct += seen != 0;
  std::printf("quantize: %lld separate, %lld packed; short last blocks: %lld; grid-stride loops (both ops): %lld; "
              "zero blocks %lld, infinite scales %lld, blocks whose multiplier MAX / amax overflows %lld\n",
              separate_cases, packed_cases, short_blocks, grid_strided, zero_blocks, infinite_scales,
              tiny_amax_blocks);
  std::printf("codes: %lld distinct bytes, %lld NaN, %lld at +-MAX, %lld subnormal; dequantize: %lld NaN outputs "
              "(%lld with other NaN bits than the CPU's)\n",
              distinct, nan_codes, saturated_codes, subnormal_codes, nan_outputs, nan_payload_differences);
  std::printf("wide paths: %lld (row, block) pairs quantized in units of 4, %lld rows dequantized in vectors of 16\n",
              vector_blocks, vector_rows);
  return summary("fp8_cuda");
}
