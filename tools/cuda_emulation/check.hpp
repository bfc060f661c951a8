// What the check programs (*_check.cpp, one per kernel file of csrc/cuda)
// share: the stand-ins for cuda_check.cu and stream_wait.cu (which hold no
// kernels), seeded sizes, counted checks, guarded buffers, the two-schedule
// race check and the summary line run.py reads. Included once per program.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "core/error.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/stream_wait.hpp"
#include "moe/elementwise.hpp"

// ---------------------------------------------------------------------------
// cuda_check.cu and stream_wait.cu on the emulation: every call succeeds, the
// stream is always idle, the device is emu::device.

namespace a2a {
bool cuda_means_unsupported(cudaError_t) { return false; }
void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) emu::fatal("check_cuda: %s failed", call);
}
void check_launch(const char*) {}
bool cuda_is_unloading() { return false; }
int current_cuda_device() { return emu::device; }
int multiprocessor_count(int device) { return emu::device_sms[device]; }
bool wait_for_stream(cudaStream_t, double, const std::function<void()>&) { return true; }
void warn_timeout(const std::string&) {}
}  // namespace a2a

namespace check {

inline std::mt19937_64 rng(12345);
inline double uniform() { return std::uniform_real_distribution<double>(0, 1)(rng); }
inline int64_t pick(std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); }
inline int64_t below(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); }

inline long long cases = 0, checks = 0, failures = 0;

inline void vfail(const char* format, va_list args) {
  if (++failures > 40) return;  // the first 40 say enough
  std::printf("FAIL ");
  std::vprintf(format, args);
  std::printf("\n");
}
inline void fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  vfail(format, args);
  va_end(args);
}
// Counts one check; a failure when !ok.
inline bool expect(bool ok, const char* format, ...) {
  ++checks;
  if (!ok) {
    va_list args;
    va_start(args, format);
    vfail(format, args);
    va_end(args);
  }
  return ok;
}

// `bytes` bytes at a chosen misalignment from a 256-byte boundary, with
// kGuard guard bytes of a known pattern on both sides. Under AddressSanitizer
// the guards are poisoned, so that a kernel reading or writing them stops
// with a report (to 8-byte granules: the bytes before a misaligned start
// that share its granule stay readable); guards_intact() verifies that
// nothing changed them in any case.
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  Guarded(size_t bytes, size_t misalignment) : bytes_(bytes) {
    storage_.resize(bytes + 2 * kGuard + 512);
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage_.data()) + kGuard;
    offset_ = static_cast<size_t>((base + 255) / 256 * 256 - reinterpret_cast<uintptr_t>(storage_.data())) +
              misalignment % 256;
    for (size_t i = 0; i < storage_.size(); ++i) storage_[i] = pattern(i);
    poison(true);
  }
  ~Guarded() { poison(false); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;

  unsigned char* data() { return storage_.data() + offset_; }
  const unsigned char* data() const { return storage_.data() + offset_; }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(data());
  }
  size_t bytes() const { return bytes_; }
  // Every byte outside the buffer still holds the pattern.
  bool guards_intact() {
    poison(false);
    bool intact = true;
    for (size_t i = 0; i < storage_.size(); ++i)
      if ((i < offset_ || i >= offset_ + bytes_) && storage_[i] != pattern(i)) intact = false;
    poison(true);
    return intact;
  }

 private:
  // Two buffers of one size and misalignment start out with the same bytes.
  unsigned char pattern(size_t i) const { return static_cast<unsigned char>(0xa5 ^ ((i - offset_) * 29)); }
  void poison(bool on) {
#if EMU_ASAN
    unsigned char* p = storage_.data();
    if (on) {
      ASAN_POISON_MEMORY_REGION(p, offset_);
      ASAN_POISON_MEMORY_REGION(p + offset_ + bytes_, storage_.size() - offset_ - bytes_);
    } else {
      ASAN_UNPOISON_MEMORY_REGION(p, storage_.size());
    }
#else
    (void)on;
#endif
  }
  std::vector<unsigned char> storage_;
  size_t bytes_, offset_ = 0;
};

// The data types of the MoE and ES kernels: their dtype, name, the unit
// roundoff of storing (store_eps) and of accumulating (acc_eps) in them.
template <typename T> a2a_dtype_t dtype_of();
template <> inline a2a_dtype_t dtype_of<float>() { return A2A_FLOAT32; }
template <> inline a2a_dtype_t dtype_of<double>() { return A2A_FLOAT64; }
template <> inline a2a_dtype_t dtype_of<a2a::half_t>() { return A2A_FLOAT16; }
template <> inline a2a_dtype_t dtype_of<a2a::bfloat16_t>() { return A2A_BFLOAT16; }
template <typename T> double store_eps();
template <> inline double store_eps<float>() { return std::ldexp(1.0, -24); }
template <> inline double store_eps<double>() { return std::ldexp(1.0, -53); }
template <> inline double store_eps<a2a::half_t>() { return std::ldexp(1.0, -11); }
template <> inline double store_eps<a2a::bfloat16_t>() { return std::ldexp(1.0, -8); }
template <typename T>
double acc_eps() {
  return std::is_same_v<T, double> ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}
template <typename T>
const char* name_of() {
  return std::is_same_v<T, float>                ? "f32"
         : std::is_same_v<T, double>             ? "f64"
         : std::is_same_v<T, a2a::half_t>        ? "f16"
                                                 : "bf16";
}
// A standard normal value as stored in T.
template <typename T>
T normal_value() {
  using Acc = typename a2a::moe::Num<T>::Acc;
  return a2a::moe::Num<T>::store(static_cast<Acc>(std::normal_distribution<double>(0, 1)(rng)));
}

// An output of an operation: the bytes that the two-schedule check compares.
struct Region {
  void* data;
  size_t bytes;
};

// Runs op under two schedules (block and thread orders, and the fill of
// __shared__ memory) from the same starting bytes of `outputs`, and counts a
// failure when anything in `outputs` differs between the two, or op's error
// (an a2a::Failure) does: a data race, or a read of shared memory that
// nobody wrote, that the ordering made visible. Leaves the second run's
// bytes (shared memory filled with 0xff: NaN, -1); returns its error message
// ("" when op did not throw). With ThreadSanitizer, which checks the
// ordering itself, op runs once.
inline std::string two_schedules(const std::string& what, std::vector<Region> outputs,
                                 const std::function<void()>& op) {
  auto run = [&] {
    try {
      op();
    } catch (const std::exception& e) {
      return std::string(e.what()[0] != '\0' ? e.what() : "(exception)");
    }
    return std::string();
  };
  const uint64_t n = static_cast<uint64_t>(cases);
  const emu::Order first = n % 2 ? emu::Order::kShuffled : emu::Order::kForward;
  const emu::Order second = n % 2 ? emu::Order::kShuffled : emu::Order::kReverse;
#if EMU_TSAN
  (void)second;
  (void)outputs;
  emu::schedule = {first, first, 2 * n, 0xff};
  return run();
#else
  emu::schedule = {first, first, 2 * n, 0x00};
  std::vector<std::vector<unsigned char>> start, after;
  for (const Region& r : outputs) {
    const unsigned char* p = static_cast<const unsigned char*>(r.data);
    start.emplace_back(p, p + r.bytes);
  }
  const std::string error = run();
  for (size_t i = 0; i < outputs.size(); ++i) {
    unsigned char* p = static_cast<unsigned char*>(outputs[i].data);
    after.emplace_back(p, p + outputs[i].bytes);
    std::copy(start[i].begin(), start[i].end(), p);
  }
  emu::schedule = {second, second, 2 * n + 1, 0xff};
  const std::string again = run();
  emu::schedule = {};
  ++checks;
  if (again != error) {
    fail("%s: the error differs between two thread orders: '%s' then '%s'", what.c_str(), error.c_str(),
         again.c_str());
    return again;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const unsigned char* p = static_cast<const unsigned char*>(outputs[i].data);
    for (size_t b = 0; b < outputs[i].bytes; ++b)
      if (p[b] != after[i][b]) {
        fail("%s: output %zu differs between two thread orders at byte %zu (%#x then %#x): a race", what.c_str(), i, b,
             after[i][b], p[b]);
        return again;
      }
  }
  return again;
#endif
}

// The lines run.py reads: every kernel instantiation run, then the totals.
inline int summary(const char* program) {
  std::vector<std::string> kernels;
  for (const auto& [name, runs] : emu::kernel_runs) {
    std::printf("kernel %s: %lld launches, %lld blocks, %lld threads\n", name.c_str(), runs.launches, runs.blocks,
                runs.threads);
    const std::string base = name.substr(0, name.find('<'));
    if (std::find(kernels.begin(), kernels.end(), base) == kernels.end()) kernels.push_back(base);
  }
  std::printf("%s: %zu kernels (%zu instantiations), %lld launches, %lld blocks, %lld threads, %lld cases, "
              "%lld checks, %lld failures\n",
              program, kernels.size(), emu::kernel_runs.size(), emu::launches, emu::blocks_run, emu::threads_run,
              cases, checks, failures);
  return failures != 0;
}

// CASES [SEED] from the command line.
inline int64_t arguments(int argc, char** argv, int64_t default_cases) {
  if (argc > 2) rng.seed(std::strtoull(argv[2], nullptr, 10));
  return argc > 1 ? std::atoll(argv[1]) : default_cases;
}

}  // namespace check
