#include "core/call_guard.hpp"

#include "a2a/a2a.h"
#include "core/error.hpp"

namespace a2a {

namespace {

// Calls inside communicators that use MPI with less than
// MPI_THREAD_MULTIPLE (the level is the process's, so it is the same for
// every such communicator).
std::atomic<int> calls_in_mpi{0};

}  // namespace

const char* mpi_thread_level_name(int level) {
  switch (level) {
    case 0: return "MPI_THREAD_SINGLE";
    case 1: return "MPI_THREAD_FUNNELED";
    case 2: return "MPI_THREAD_SERIALIZED";
    case 3: return "MPI_THREAD_MULTIPLE";
    default: return "no MPI";
  }
}

CallGuard::CallGuard(CallGate& gate, const char* op, int rank, bool communicates) : gate_(gate) {
  if (gate.counters_ != nullptr) gate.counters_->add(Count::kCalls);
  const char* other = nullptr;
  if (!gate.inside_.compare_exchange_strong(other, op))
    fail(A2A_ERROR_UNSUPPORTED, op, " on rank ", rank, ": another thread is inside ", other,
         " on this communicator; calls on one communicator must not overlap (MPI forbids concurrent collectives on "
         "one communicator too): make them one at a time, or give each thread a communicator of its own");
  const int level = gate.mpi_thread_level_;
  if (!communicates || level == kNoMpi || level >= kMpiThreadMultiple) return;
  if (calls_in_mpi.fetch_add(1) != 0) {
    calls_in_mpi.fetch_sub(1);
    gate.inside_.store(nullptr);
    fail(A2A_ERROR_UNSUPPORTED, op, " on rank ", rank, ": another thread is inside an a2a call that uses MPI, and "
         "MPI grants this process only ", mpi_thread_level_name(level), " (MPI_Query_thread); calls from several "
         "threads at once need MPI_THREAD_MULTIPLE: initialize MPI with it (mpi4py requests it unless "
         "mpi4py.rc.thread_level says otherwise), or make the calls one at a time");
  }
  counted_ = true;
}

CallGuard::~CallGuard() {
  if (counted_) calls_in_mpi.fetch_sub(1);
  gate_.inside_.store(nullptr);
}

}  // namespace a2a
