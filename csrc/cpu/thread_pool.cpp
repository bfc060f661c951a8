#include "cpu/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>

#include <pthread.h>
#include <thread>
#include <vector>

#include "core/error.hpp"

namespace a2a::cpu {

namespace {

// Workers sleep on a condition variable between jobs. A job is a number of
// slices; every participant (the workers and the caller) claims slices from
// an atomic counter until none are left.
class ThreadPool {
 public:
  static ThreadPool& instance() {
    // Leaked on purpose: joining threads during static destruction can
    // deadlock when the process exits from another thread.
    static const bool registered = [] {
      // A forked child has none of the parent's workers (and its mutexes may
      // be held by threads that do not exist there): it starts a new pool
      // instead of waiting forever for the old one. The old one is leaked.
      pthread_atfork(nullptr, nullptr, [] { current_.store(new ThreadPool()); });
      return true;
    }();
    (void)registered;
    if (current_.load() == nullptr) {
      static std::once_flag once;
      std::call_once(once, [] { current_.store(new ThreadPool()); });
    }
    return *current_.load();
  }

  void run(int slices, int threads, const std::function<void(int)>& slice_body) {
    std::lock_guard<std::mutex> serial(run_mutex_);
    ensure_workers(threads - 1);
    std::unique_lock<std::mutex> lock(mutex_);
    body_ = &slice_body;
    slices_ = slices;
    next_slice_.store(0);
    active_workers_ = std::min<int>(threads - 1, static_cast<int>(workers_.size()));
    busy_ = active_workers_;
    error_ = nullptr;
    ++generation_;
    lock.unlock();
    wake_.notify_all();
    work();  // the caller takes part
    lock.lock();
    done_.wait(lock, [&] { return busy_ == 0; });
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void ensure_workers(int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < count) {
      // A new worker waits for the next job, not the last one.
      const int index = static_cast<int>(workers_.size());
      const uint64_t current = generation_;
      workers_.emplace_back([this, index, current] { worker_loop(index, current); });
      workers_.back().detach();
    }
  }

  void worker_loop(int index, uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= active_workers_) continue;  // this job uses fewer threads
      lock.unlock();
      work();
      lock.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }

  void work() {
    for (;;) {
      const int slice = next_slice_.fetch_add(1);
      if (slice >= slices_) return;
      try {
        (*body_)(slice);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* body_ = nullptr;
  int slices_ = 0;
  std::atomic<int> next_slice_{0};
  int active_workers_ = 0;
  int busy_ = 0;
  uint64_t generation_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;

  static inline std::atomic<ThreadPool*> current_{nullptr};
};

}  // namespace

int default_num_threads() {
  static const int threads = [] {
    if (const char* text = std::getenv("A2A_NUM_THREADS"); text != nullptr && *text != '\0') {
      char* end = nullptr;
      const long value = std::strtol(text, &end, 10);
      if (*end != '\0' || value < 1 || value > 4096)
        fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_NUM_THREADS=", text, " is not a thread count between 1 and 4096");
      return static_cast<int>(value);
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return threads;
}

int slice_count(int64_t n, int64_t grain, int num_threads) {
  if (num_threads <= 0) num_threads = default_num_threads();
  if (n <= 0) return 0;
  const int64_t by_grain = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  return static_cast<int>(std::min<int64_t>(num_threads, by_grain));
}

void parallel_for(int64_t n, int64_t grain, int num_threads, const std::function<void(int64_t, int64_t)>& body) {
  const int slices = slice_count(n, grain, num_threads);
  if (slices == 0) return;
  if (slices == 1) {
    body(0, n);
    return;
  }
  ThreadPool::instance().run(slices, slices, [&](int s) { body(n * s / slices, n * (s + 1) / slices); });
}

}  // namespace a2a::cpu
