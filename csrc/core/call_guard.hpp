// Calls from several threads. Two threads inside calls on the same
// communicator is an error (MPI forbids concurrent collectives on one
// communicator too); two threads inside calls that use MPI, on any
// communicators, need MPI_THREAD_MULTIPLE. The C entry points hold a
// CallGuard for the length of every call on a communicator, so both fail
// clearly, before anything is sent, instead of corrupting MPI's state.
#pragma once

#include <atomic>

#include "core/counters.hpp"

namespace a2a {

// MPI's thread support for the process, as creation found it
// (MPI_Query_thread): the values of a2a_mpi_thread_level_t.
constexpr int kNoMpi = -1;  // a communicator that does not use MPI
constexpr int kMpiThreadMultiple = 3;
// "MPI_THREAD_SINGLE" ... "MPI_THREAD_MULTIPLE", or "no MPI".
const char* mpi_thread_level_name(int level);

// Per communicator (Comm::call_gate()): which call is inside, and whether
// the communicator uses MPI and with what thread support.
class CallGate {
 public:
  void set_mpi_thread_level(int level) { mpi_thread_level_ = level; }
  int mpi_thread_level() const { return mpi_thread_level_; }
  // Where each call through this gate is counted (Count::kCalls): its comm's.
  void set_counters(Counters* counters) { counters_ = counters; }

 private:
  friend class CallGuard;
  Counters* counters_ = nullptr;
  std::atomic<const char*> inside_{nullptr};  // the op of the call inside, if any
  int mpi_thread_level_ = kNoMpi;
};

// Held for the length of one call on a communicator. Throws
// A2A_ERROR_UNSUPPORTED when another thread is inside a call on the same
// communicator, or when `communicates`, the communicator uses MPI, MPI grants
// less than MPI_THREAD_MULTIPLE and another thread is inside a call that uses
// MPI (on any communicator).
class CallGuard {
 public:
  CallGuard(CallGate& gate, const char* op, int rank, bool communicates = true);
  ~CallGuard();
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  CallGate& gate_;
  bool counted_ = false;  // counted among the calls inside MPI
};

}  // namespace a2a
