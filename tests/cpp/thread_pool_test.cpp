// The CPU kernels' thread pool (csrc/cpu/thread_pool.cpp), built from its
// source by tests/unit/test_thread_pool.py. Each check runs under a watchdog:
// a deadlock prints which check hung and exits 2 instead of hanging.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "cpu/thread_pool.hpp"

using a2a::cpu::parallel_for;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  }
}

// Runs check() on a thread; exits 2 if it does not return within `seconds`.
template <typename Check>
void within(const char* name, double seconds, Check&& check) {
  std::atomic<bool> done{false};
  std::thread runner([&] {
    check();
    done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!done) {
    std::printf("FAIL: %s did not finish within %.0f s (deadlock)\n", name, seconds);
    std::fflush(stdout);
    std::_Exit(2);
  }
  runner.join();
  std::printf("ok: %s\n", name);
}

// Waits until `count` reaches `target` or `seconds` pass; true when reached.
bool wait_for(const std::atomic<int>& count, int target, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (count.load() < target)
    if (std::chrono::steady_clock::now() > deadline) return false;
    else std::this_thread::yield();
  return true;
}

}  // namespace

int main() {
  within("nested parallel_for runs inline on the calling worker", 30, [] {
    std::atomic<long> sum{0};
    std::atomic<int> inner_calls{0};
    parallel_for(8, 1, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        parallel_for(1000, 1, 4, [&](int64_t b, int64_t e) {
          inner_calls.fetch_add(1);
          for (int64_t j = b; j < e; ++j) sum.fetch_add(1);
        });
    });
    expect(sum.load() == 8 * 1000, "nested: every element once, got " + std::to_string(sum.load()));
    expect(inner_calls.load() == 8, "nested: each inner loop is one inline call, got " +
                                        std::to_string(inner_calls.load()));
  });

  within("a nested slice's exception reaches the outer caller", 30, [] {
    bool caught = false;
    try {
      parallel_for(4, 1, 4, [](int64_t, int64_t) {
        parallel_for(100, 1, 4, [](int64_t b, int64_t) {
          if (b == 0) throw std::runtime_error("inner");
        });
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "inner";
    }
    expect(caught, "nested exception rethrown to the outer caller");
  });

  within("callers on two threads run at once", 30, [] {
    // Each caller's two slices wait until all four slices (both callers')
    // are running: callers serialized by one pool would never get there.
    std::atomic<int> running{0};
    std::atomic<int> met{0};
    auto caller = [&] {
      parallel_for(2, 1, 2, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          running.fetch_add(1);
          if (wait_for(running, 4, 10.0)) met.fetch_add(1);
        }
      });
    };
    std::thread first(caller), second(caller);
    first.join();
    second.join();
    expect(met.load() == 4, "concurrent callers: " + std::to_string(met.load()) +
                                " of 4 slices saw both jobs running at once");
  });

  within("a pool is reused after concurrent use", 30, [] {
    std::atomic<long> sum{0};
    for (int round = 0; round < 50; ++round)
      parallel_for(64, 1, 3, [&](int64_t begin, int64_t end) { sum.fetch_add(end - begin); });
    expect(sum.load() == 50 * 64, "sequential jobs after concurrent ones");
  });

  within("threads per rank share the cores", 5, [] {
    // Run without A2A_NUM_THREADS (tests/unit/test_thread_pool.py clears it).
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    expect(a2a::cpu::threads_per_rank(1) == cores, "one rank on the host gets every core");
    expect(a2a::cpu::threads_per_rank(cores * 4) == 1, "more ranks than cores get one thread each");
    expect(a2a::cpu::threads_per_rank(0) == cores, "an unknown rank count counts as one");
  });

  std::printf("%s\n", failures == 0 ? "all passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
