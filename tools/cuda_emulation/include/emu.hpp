// The scheduler of the CUDA emulation (cuda_runtime.h is its CUDA face; see
// run.py). A launch runs its blocks one after another, in a chosen order; a
// block runs one fiber per CUDA thread on the calling thread, in a chosen
// order, each until it reaches a barrier (__syncthreads, a warp collective)
// or returns. So a block's run is deterministic for a given
// Schedule, and a different Schedule is a different legal interleaving:
// output that changes with the order is a race (emu::Schedule, check.hpp).
//
// Barriers wait for every thread of the block (warp collectives: every lane
// of the warp, full mask only); when no fiber can run and some have not
// returned, the launch stops with a deadlock report naming who waits where.
// __shared__ declarations (rewritten by run.py into emu::shared) live in a
// fresh 48 KiB arena per block, filled with Schedule::shared_fill, so a read
// of shared memory nobody wrote shows up as a change with the fill; under
// AddressSanitizer the arena outside the declared arrays is poisoned.
//
// Under ThreadSanitizer (-fsanitize=thread) every fiber is a TSan fiber and
// fiber switches carry no synchronization: the only happens-before edges are
// the ones CUDA guarantees, which the emulation declares itself: launch start
// -> every thread, __syncthreads and __syncwarp between the threads they
// join, every thread -> launch end. Shuffles, matches and ballots exchange
// values but do not order memory, as on the GPU. So TSan reports two threads
// of a block, or of two successive blocks, touching the same byte without
// such an edge (one of them writing, not both atomically), whatever order
// they ran in.
// Limitation: fibers are reused every other block, so blocks b and b + 2 are
// ordered through them (a race between them goes unseen).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>
#if !defined(__x86_64__) || defined(EMU_UCONTEXT)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define EMU_TSAN 1
#else
#define EMU_TSAN 0
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline dim3 blockDim, gridDim;

namespace emu {

[[noreturn]] inline void fatal(const char* format, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "emu: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::abort();
}

// Fiber contexts. On x86-64 a switch saves the callee-saved registers on the
// old stack and pops them from the new one (the sanitizers are told through
// their fiber interfaces); elsewhere, or with -DEMU_UCONTEXT, ucontext, whose
// swapcontext ASan intercepts with a warning.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
extern "C" void emu_switch_context(void** save_sp, void* next_sp);
asm(R"(
  .pushsection .text
  .weak emu_switch_context
  .type emu_switch_context, @function
emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_context, .-emu_switch_context
  .popsection
)");
struct Context {
  void* sp = nullptr;
};
// A context that starts entry() (which must never return) on the stack.
// Neither function is instrumented: the scheduler's writes to a fiber's stack
// and stack pointer are no data of the emulated program.
#if EMU_TSAN
#define EMU_UNINSTRUMENTED __attribute__((no_sanitize_thread))
#else
#define EMU_UNINSTRUMENTED
#endif
EMU_UNINSTRUMENTED inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<uintptr_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15});
  top[-1] = 0;                                    // entry's return address: none
  top[-2] = reinterpret_cast<uintptr_t>(entry);   // where the first switch returns to
  for (int i = 3; i <= 8; ++i) top[-i] = 0;       // rbp, rbx, r12-r15
  c.sp = top - 8;
}
EMU_UNINSTRUMENTED inline void swap_context(Context& from, Context& to) { emu_switch_context(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void swap_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// The order in which a launch runs its blocks and a block its threads (each
// segment between two barriers runs thread by thread in this order).
enum class Order { kForward, kReverse, kShuffled };
struct Schedule {
  Order blocks = Order::kForward;
  Order threads = Order::kForward;
  uint64_t seed = 0;                 // for kShuffled
  unsigned char shared_fill = 0xff;  // every byte of __shared__ memory at block start
};
inline Schedule schedule;

// The PTX version that cudaFuncGetAttributes reports (es_cuda.cu takes the
// tensor-core ESMM from 80 up); the SM count of each emulated device
// (cudaGetDevice returns `device`).
inline int ptx_version = 80;
inline int device = 0;
inline int device_sms[64] = {1, 2, 3, 5, 132};

struct KernelRuns {
  long long launches = 0, blocks = 0, threads = 0;
};
inline std::map<std::string, KernelRuns> kernel_runs;  // by kernel name
inline long long launches = 0, blocks_run = 0, threads_run = 0;

constexpr unsigned kWarp = 32;
constexpr size_t kSharedBytes = 48 << 10;  // static shared memory of a block
constexpr size_t kSharedRedzone = 64;      // poisoned gap between two __shared__ arrays
constexpr size_t kStackBytes = 128 << 10;  // per fiber, plus a guard page below

// The scheduler's own state is written by fibers and read by the scheduler
// (and the reverse); relaxed atomics make that neither a race nor a
// synchronization for ThreadSanitizer. Single-threaded, they cost nothing.
template <class T>
struct Cell {
  std::atomic<T> v{};
  T get() const { return v.load(std::memory_order_relaxed); }
  void set(T x) { v.store(x, std::memory_order_relaxed); }
};

enum Wait : int { kRunnable, kAtSyncthreads, kAtWarp, kDone };
enum Collective : int { kSyncwarp, kShuffle, kMatch, kBallot };
inline const char* collective_name(int op) {
  return op == kSyncwarp ? "__syncwarp"
         : op == kShuffle ? "__shfl_*_sync"
         : op == kMatch   ? "__match_any_sync"
                          : "__ballot_sync";
}

struct Lane {
  Context context;
  char* stack = nullptr;
  void* tsan_fiber = nullptr;
  void* fake_stack = nullptr;
  Cell<int> wait;
  Cell<unsigned> index;  // linear thread index in the block
};

struct WarpState {
  Cell<unsigned> arrived, generation;
  Cell<int> op;
  Cell<uint64_t> value[2][kWarp];  // by generation parity, so that a fast lane cannot overwrite a slow lane's input
  char sync[2];                    // TSan sync objects of __syncwarp, by generation parity
};

struct BlockState {
  dim3 index;
  unsigned threads = 0;
  Cell<unsigned> arrived, generation;
  char sync[2];  // TSan sync objects of __syncthreads, by generation parity
  std::unique_ptr<WarpState[]> warps;
  char* shared = nullptr;
  Cell<size_t> shared_used;
  struct Entry {
    Cell<const void*> key;
    Cell<size_t> offset;
  } entries[32];
  Cell<unsigned> entry_count;
};

class Runtime {
 public:
  ~Runtime() {
    for (auto& lane : lanes_) {
#if EMU_TSAN
      if (lane->tsan_fiber != nullptr) __tsan_destroy_fiber(lane->tsan_fiber);
#endif
      if (lane->stack != nullptr) munmap(lane->stack - kPage, kStackBytes + kPage);
    }
  }

  void launch(const char* name, unsigned max_threads, dim3 grid, dim3 block, size_t dynamic_shared,
              const std::function<void()>& body) {
    if (current_.get() != nullptr) fatal("%s: a launch from device code is not emulated", name);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
      fatal("%s: launch with an empty grid (%u,%u,%u) or block (%u,%u,%u)", name, grid.x, grid.y, grid.z, block.x,
            block.y, block.z);
    if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
      fatal("%s: grid (%u,%u,%u) above the limits (2^31-1, 65535, 65535)", name, grid.x, grid.y, grid.z);
    const uint64_t threads = uint64_t{block.x} * block.y * block.z;
    if (threads > 1024 || block.z > 64) fatal("%s: block (%u,%u,%u) above the limits", name, block.x, block.y, block.z);
    if (threads > max_threads)
      fatal("%s: %llu threads per block, above its __launch_bounds__ of %u", name, (unsigned long long)threads,
            max_threads);
    if (dynamic_shared != 0) fatal("%s: dynamic shared memory (%zu bytes) is not emulated", name, dynamic_shared);
    const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
    KernelRuns& runs = kernel_runs[name];
    ++runs.launches;
    runs.blocks += static_cast<long long>(blocks);
    runs.threads += static_cast<long long>(blocks * threads);
    ++launches;
    blocks_run += static_cast<long long>(blocks);
    threads_run += static_cast<long long>(blocks * threads);

    gridDim = grid;
    blockDim = block;
    body_ = &body;
    threads_ = static_cast<unsigned>(threads);
    while (lanes_.size() < 2 * threads_) lanes_.push_back(std::make_unique<Lane>());
    // The blocks of this launch keep their state (and shared arena) to the
    // end: under TSan it may only be released after the launch's end edge.
    std::vector<std::unique_ptr<BlockState>> states;
    const std::vector<uint64_t> order = permutation(blocks, schedule.blocks, launches);
    for (uint64_t i = 0; i < order.size(); ++i) {
      const uint64_t b = order[i];
      states.push_back(std::make_unique<BlockState>());
      BlockState& state = *states.back();
      state.index = dim3(static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                         static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y)));
      run_block(state, i % 2, name);
    }
#if EMU_TSAN
    __tsan_acquire(&end_sync_);  // every thread of the launch happens before what follows it
#endif
    for (auto& state : states) release_shared(*state);
  }

  dim3 thread_index() const {
    const unsigned t = lane().index.get();
    return dim3(t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y));
  }
  dim3 block_index() const { return block().index; }
  unsigned linear_thread() const { return lane().index.get(); }

  void syncthreads() {
    BlockState& b = block();
    Lane& me = lane();
    const unsigned generation = b.generation.get();
#if EMU_TSAN
    __tsan_release(&b.sync[generation & 1]);
#endif
    if (b.arrived.get() + 1 == b.threads) {
      b.arrived.set(0);
      b.generation.set(generation + 1);
      for (unsigned t = 0; t < b.threads; ++t) {
        Lane& other = lane_of(t);
        if (other.wait.get() == kAtSyncthreads) other.wait.set(kRunnable);
      }
      me.wait.set(kRunnable);  // yields all the same: the order decides who runs first after the barrier
    } else {
      b.arrived.set(b.arrived.get() + 1);
      me.wait.set(kAtSyncthreads);
    }
    yield();
#if EMU_TSAN
    __tsan_acquire(&b.sync[generation & 1]);
#endif
  }

  // A full-mask warp collective: every lane deposits `value`, waits for the
  // other 31, and gets the 32 values (indexed by lane).
  const Cell<uint64_t>* warp_collective(int op, unsigned mask, uint64_t value) {
    if (mask != 0xffffffffu)
      fatal("%s with mask %#x: only full-mask collectives are emulated", collective_name(op), mask);
    if (threads_ % kWarp != 0) fatal("%s in a block of %u threads (not whole warps)", collective_name(op), threads_);
    BlockState& b = block();
    Lane& me = lane();
    const unsigned t = me.index.get(), lane_id = t % kWarp;
    WarpState& w = b.warps[t / kWarp];
    const unsigned generation = w.generation.get(), slot = generation & 1;
    if (w.arrived.get() == 0)
      w.op.set(op);
    else if (w.op.get() != op)
      fatal("block (%u,%u,%u) warp %u: lane %u is at %s while other lanes are at %s (divergent warp collectives)",
            b.index.x, b.index.y, b.index.z, t / kWarp, lane_id, collective_name(op), collective_name(w.op.get()));
    w.value[slot][lane_id].set(value);
#if EMU_TSAN
    if (op == kSyncwarp) __tsan_release(&w.sync[slot]);
#endif
    if (w.arrived.get() + 1 == kWarp) {
      w.arrived.set(0);
      w.generation.set(generation + 1);
      for (unsigned l = 0; l < kWarp; ++l) lane_of(t - lane_id + l).wait.set(kRunnable);
    } else {
      w.arrived.set(w.arrived.get() + 1);
      me.wait.set(kAtWarp);
    }
    yield();
#if EMU_TSAN
    if (op == kSyncwarp) __tsan_acquire(&w.sync[slot]);
#endif
    return w.value[slot];
  }

  // The block's instance of one __shared__ declaration (key: unique per
  // declaration and type).
  void* shared(const void* key, size_t bytes, size_t align) {
    BlockState& b = block();
    const unsigned n = b.entry_count.get();
    for (unsigned i = 0; i < n; ++i)
      if (b.entries[i].key.get() == key) return b.shared + b.entries[i].offset.get();
    if (n == sizeof b.entries / sizeof b.entries[0]) fatal("more than 32 __shared__ declarations in one kernel");
    const size_t used = b.shared_used.get();
    const size_t offset = (used + (used != 0 ? kSharedRedzone : 0) + align - 1) / align * align;
    if (offset + bytes > kSharedBytes)
      fatal("__shared__ memory of block (%u,%u,%u) exceeds %zu bytes", b.index.x, b.index.y, b.index.z, kSharedBytes);
#if EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(b.shared + offset, bytes);
#endif
    b.shared_used.set(offset + bytes);
    b.entries[n].key.set(key);
    b.entries[n].offset.set(offset);
    b.entry_count.set(n + 1);
    return b.shared + offset;
  }

 private:
  static constexpr size_t kPage = 4096;

  Lane& lane() const {
    Lane* l = current_.get();
    if (l == nullptr) fatal("threadIdx, a barrier or __shared__ used outside a kernel");
    return *l;
  }
  BlockState& block() const { return *block_.get(); }
  // Blocks alternate between two sets of fibers (see the TSan note above).
  Lane& lane_of(unsigned t) { return *lanes_[half_.get() * threads_ + t]; }

  static std::vector<uint64_t> permutation(uint64_t n, Order order, uint64_t salt) {
    std::vector<uint64_t> p(n);
    for (uint64_t i = 0; i < n; ++i) p[i] = order == Order::kReverse ? n - 1 - i : i;
    if (order == Order::kShuffled) {
      std::mt19937_64 rng(schedule.seed * 0x9e3779b97f4a7c15ull + salt);
      std::shuffle(p.begin(), p.end(), rng);
    }
    return p;
  }

  void run_block(BlockState& b, unsigned half, const char* name) {
    half_.set(half);
    b.threads = threads_;
    b.warps.reset(new WarpState[(threads_ + kWarp - 1) / kWarp]);
    b.shared = static_cast<char*>(::operator new(kSharedBytes, std::align_val_t{256}));
    std::memset(b.shared, schedule.shared_fill, kSharedBytes);
#if EMU_ASAN
    ASAN_POISON_MEMORY_REGION(b.shared, kSharedBytes);
#endif
    block_.set(&b);
    for (unsigned t = 0; t < threads_; ++t) {
      Lane& l = lane_of(t);
      if (l.stack == nullptr) {
        void* memory = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (memory == MAP_FAILED) fatal("cannot map a fiber stack");
        mprotect(memory, kPage, PROT_NONE);  // a stack overflow faults instead of corrupting the neighbour
        l.stack = static_cast<char*>(memory) + kPage;
#if EMU_TSAN
        l.tsan_fiber = __tsan_create_fiber(0);
#endif
      }
      l.index.set(t);
      l.wait.set(kRunnable);
      make_context(l.context, l.stack, kStackBytes, &Runtime::fiber_main);
    }
#if EMU_TSAN
    if (main_fiber_ == nullptr) main_fiber_ = __tsan_get_current_fiber();
    __tsan_release(&start_sync_);  // what the host did so far happens before every thread
#endif
    const uint64_t block_number = (uint64_t{b.index.z} * gridDim.y + b.index.y) * gridDim.x + b.index.x;
    const std::vector<uint64_t> order = permutation(threads_, schedule.threads, launches * 1000003 + block_number);
    for (;;) {
      bool ran = false;
      for (const uint64_t t : order) {
        Lane& l = lane_of(static_cast<unsigned>(t));
        if (l.wait.get() != kRunnable) continue;
        ran = true;
        switch_to(l);
      }
      unsigned done = 0;
      for (unsigned t = 0; t < threads_; ++t) done += lane_of(t).wait.get() == kDone;
      if (done == threads_) break;
      if (!ran) deadlock(b, name, done);
    }
    block_.set(nullptr);
  }

  void release_shared(BlockState& b) {
#if EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(b.shared, kSharedBytes);
#endif
    ::operator delete(b.shared, std::align_val_t{256});
    b.shared = nullptr;
  }

  [[noreturn]] void deadlock(BlockState& b, const char* name, unsigned done) {
    unsigned at_barrier = 0, at_warp = 0, first_warp = ~0u;
    for (unsigned t = 0; t < threads_; ++t) {
      const int w = lane_of(t).wait.get();
      at_barrier += w == kAtSyncthreads;
      if (w == kAtWarp) {
        ++at_warp;
        first_warp = std::min(first_warp, t);
      }
    }
    if (at_warp != 0) {
      const WarpState& w = b.warps[first_warp / kWarp];
      fatal("%s: deadlock in block (%u,%u,%u): %u of %u threads at __syncthreads, %u at warp collectives (warp %u: "
            "%u lanes at %s), %u returned: a barrier or warp collective that not every thread reaches",
            name, b.index.x, b.index.y, b.index.z, at_barrier, threads_, at_warp, first_warp / kWarp, w.arrived.get(),
            collective_name(w.op.get()), done);
    }
    fatal("%s: deadlock in block (%u,%u,%u): %u of %u threads wait at __syncthreads, %u returned: a __syncthreads "
          "that not every thread reaches",
          name, b.index.x, b.index.y, b.index.z, at_barrier, threads_, done);
  }

  void switch_to(Lane& l) {
    current_.set(&l);
#if EMU_TSAN
    __tsan_switch_to_fiber(l.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&scheduler_fake_stack_, l.stack, kStackBytes);
#endif
    swap_context(scheduler_, l.context);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(scheduler_fake_stack_, nullptr, nullptr);
#endif
    current_.set(nullptr);
  }

  // From a fiber back to the scheduler; returns when the scheduler resumes it.
  void yield() {
    Lane& me = lane();
#if EMU_TSAN
    __tsan_switch_to_fiber(main_fiber_, __tsan_switch_to_fiber_no_sync);
#endif
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&me.fake_stack, main_stack_bottom_, main_stack_size_);
#endif
    swap_context(me.context, scheduler_);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(me.fake_stack, &main_stack_bottom_, &main_stack_size_);
#endif
  }

  static void fiber_main();

  std::vector<std::unique_ptr<Lane>> lanes_;
  unsigned threads_ = 0;
  Cell<unsigned> half_;  // which set of fibers the block runs on
  Cell<Lane*> current_;
  Cell<BlockState*> block_;
  const std::function<void()>* body_ = nullptr;
  Context scheduler_;
  void* scheduler_fake_stack_ = nullptr;
  const void* main_stack_bottom_ = nullptr;
  size_t main_stack_size_ = 0;
  void* main_fiber_ = nullptr;
  char start_sync_ = 0, end_sync_ = 0;
};

inline Runtime runtime;

inline void Runtime::fiber_main() {
  Runtime& r = runtime;
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r.main_stack_bottom_, &r.main_stack_size_);
#endif
#if EMU_TSAN
  __tsan_acquire(&r.start_sync_);
#endif
  (*r.body_)();
  Lane& me = r.lane();
  me.wait.set(kDone);
#if EMU_TSAN
  __tsan_release(&r.end_sync_);
  __tsan_switch_to_fiber(r.main_fiber_, __tsan_switch_to_fiber_no_sync);
#endif
#if EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, r.main_stack_bottom_, r.main_stack_size_);
#endif
  swap_context(me.context, r.scheduler_);
  fatal("a finished fiber was resumed");
}

inline void launch(const char* name, unsigned max_threads, dim3 grid, dim3 block, size_t dynamic_shared,
                   const std::function<void()>& body) {
  runtime.launch(name, max_threads, grid, block, dynamic_shared, body);
}

// "name<template arguments>" of a kernel (run.py passes &kernel<...>), for
// the counts of kernel_runs.
template <auto Kernel>
const char* kernel_name() {
  static const std::string name = [](std::string text) {
    // text: "... [with auto Kernel = a2a::{anonymous}::name<args>]"
    const size_t at = text.find("Kernel = ");
    if (at != std::string::npos) text = text.substr(at + 9, text.size() - at - 10);
    for (const char* prefix : {"{anonymous}::", "a2a::", "moe::"})
      for (size_t p; (p = text.find(prefix)) != std::string::npos;) text.erase(p, std::strlen(prefix));
    return text;
  }(__PRETTY_FUNCTION__);
  return name.c_str();
}

// `__shared__ [__align__(A)] T name[dims];` becomes
// `auto& name = emu::shared<T[dims], A, id>();` (run.py).
template <class T, size_t Align, int Id>
T& shared() {
  static const char key = 0;  // one address per declaration and type
  return *static_cast<T*>(runtime.shared(&key, sizeof(T), std::max(Align, alignof(T))));
}

}  // namespace emu
