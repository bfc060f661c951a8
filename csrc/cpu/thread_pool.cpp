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

// True on a thread while it runs slices of a job: a pool's workers always,
// a caller during its own job. parallel_for there runs inline.
thread_local bool in_pool_body = false;

// Sets in_pool_body for a scope and restores it.
class InPoolBody {
 public:
  InPoolBody() : previous_(in_pool_body) { in_pool_body = true; }
  ~InPoolBody() { in_pool_body = previous_; }
  InPoolBody(const InPoolBody&) = delete;
  InPoolBody& operator=(const InPoolBody&) = delete;

 private:
  bool previous_;
};

// Workers sleep on a condition variable between jobs. A job is a number of
// slices; every participant (the workers and the caller) claims slices from
// an atomic counter until none are left. One caller at a time: Pools lends
// each caller a pool of its own.
class ThreadPool {
 public:
  void run(int slices, int threads, const std::function<void(int)>& slice_body) {
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
    {
      const InPoolBody inside;
      work();  // the caller takes part
    }
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
    in_pool_body = true;
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
};

// The pools of the process. A caller borrows an idle one for its job (a new
// one when every pool is busy), so that callers on several threads run at
// once rather than one after the other; a process that calls from one thread
// at a time has one pool. Concurrent jobs each use their own threads (the
// machine may then be oversubscribed, as with concurrent OpenMP regions).
class Pools {
 public:
  static Pools& instance() {
    // Leaked on purpose: joining threads during static destruction can
    // deadlock when the process exits from another thread.
    static const bool registered = [] {
      // A forked child has none of the parent's workers (and its mutexes may
      // be held by threads that do not exist there): it starts anew instead
      // of waiting forever for the old pools. The old ones are leaked.
      pthread_atfork(nullptr, nullptr, [] { current_.store(new Pools()); });
      return true;
    }();
    (void)registered;
    if (current_.load() == nullptr) {
      static std::once_flag once;
      std::call_once(once, [] { current_.store(new Pools()); });
    }
    return *current_.load();
  }

  // A pool lent for one job, given back when the lease ends.
  class Lease {
   public:
    explicit Lease(Pools& pools) : pools_(pools), pool_(pools.take()) {}
    ~Lease() { pools_.give_back(pool_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ThreadPool& pool() { return *pool_; }

   private:
    Pools& pools_;
    ThreadPool* pool_;
  };

 private:
  ThreadPool* take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (idle_.empty()) return new ThreadPool();  // kept for later jobs, never deleted
    ThreadPool* pool = idle_.back();
    idle_.pop_back();
    return pool;
  }
  void give_back(ThreadPool* pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(pool);
  }

  std::mutex mutex_;
  std::vector<ThreadPool*> idle_;

  static inline std::atomic<Pools*> current_{nullptr};
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

int threads_per_rank(int ranks_on_host) {
  if (const char* text = std::getenv("A2A_NUM_THREADS"); text != nullptr && *text != '\0') return default_num_threads();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_on_host));
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
  // Inside a job's slice (a nested parallel_for) the work runs inline: the
  // other threads are busy with the outer job, and waiting for them from
  // one of its slices would deadlock.
  if (slices == 1 || in_pool_body) {
    body(0, n);
    return;
  }
  Pools::Lease lease(Pools::instance());
  lease.pool().run(slices, slices, [&](int s) { body(n * s / slices, n * (s + 1) / slices); });
}

int64_t grain_for(int64_t elements_per_item) {
  constexpr int64_t kGrainElements = int64_t{1} << 15;
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

}  // namespace a2a::cpu
