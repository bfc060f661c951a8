// What calls cost, counted where the cost is paid: rounds and messages on the
// data and control paths, the cross-rank check's own rounds, host waits for
// the device, device operations and allocations, per communicator and for
// the process (a2a_counters). The CPU path counts the waits a GPU would pay
// at the same places, since it runs the same code: a CPU test can hold a
// budget for the GPU's host overhead.
#pragma once

#include <atomic>
#include <cstdint>

#include "a2a/a2a.h"

namespace a2a {

enum class Count {
  kCalls,            // entries into the library (per communicator: calls on it)
  kCollectives,      // collectives and checked calls started
  kDataRounds,       // exchanges and collectives on the data transport
  kDataMessages,     // point-to-point messages posted to other ranks on the data transport
  kControlRounds,    // the same on the control transport
  kControlMessages,
  kCheckRounds,      // rounds run for the cross-rank check alone (also control rounds)
  kHostWaits,        // the host waited for the device (or would, on a GPU)
  kKernelCalls,      // device operations enqueued: copies, layout transposes, MoE kernels
  kAllocations,      // buffers the library allocated itself
  kNumCounts
};

class Counters {
 public:
  void add(Count what, int64_t n = 1) {
    values_[static_cast<int>(what)].fetch_add(n, std::memory_order_relaxed);
  }
  void read(a2a_counters_t* out) const;

 private:
  std::atomic<int64_t> values_[static_cast<int>(Count::kNumCounts)] = {};
};

// The process's totals, over every communicator and the calls without one.
Counters& process_counters();

// Adds to the process's counters and, when given, a communicator's.
inline void count(Counters* comm, Count what, int64_t n = 1) {
  process_counters().add(what, n);
  if (comm != nullptr) comm->add(what, n);
}

}  // namespace a2a
