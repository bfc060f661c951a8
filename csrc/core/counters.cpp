#include "core/counters.hpp"

#include <cstring>

namespace a2a {

Counters& process_counters() {
  static Counters counters;
  return counters;
}

void Counters::read(a2a_counters_t* out) const {
  auto at = [&](Count what) { return values_[static_cast<int>(what)].load(std::memory_order_relaxed); };
  out->calls = at(Count::kCalls);
  out->collectives = at(Count::kCollectives);
  out->data_rounds = at(Count::kDataRounds);
  out->data_messages = at(Count::kDataMessages);
  out->control_rounds = at(Count::kControlRounds);
  out->control_messages = at(Count::kControlMessages);
  out->check_rounds = at(Count::kCheckRounds);
  out->host_waits = at(Count::kHostWaits);
  out->kernel_calls = at(Count::kKernelCalls);
  out->allocations = at(Count::kAllocations);
}

}  // namespace a2a
