// What the MPI transport's files share: message tags, error text, the
// datatypes of spans, and the pacing of a bounded wait.
#pragma once

#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>

#include "core/error.hpp"
#include "core/transport.hpp"

namespace a2a {

// Messages of the collectives and of allgather never match each other, nor
// the notices of a disagreement, nor the signed messages, whose tags are
// kFirstSignedTag and up (see mpi_signed.cpp).
inline constexpr int kDataTag = 1;
inline constexpr int kGatherTag = 2;
inline constexpr int kNoticeTag = 3;
inline constexpr int kFirstSignedTag = 16;

// MPI's text for an error code.
std::string mpi_error_text(int code);

#define A2A_MPI_CHECK(call, ...)                                                            \
  do {                                                                                      \
    int a2a_mpi_rc = (call);                                                                \
    if (a2a_mpi_rc != MPI_SUCCESS)                                                          \
      fail(A2A_ERROR_TRANSPORT, __VA_ARGS__, ": " #call " failed: ", mpi_error_text(a2a_mpi_rc)); \
  } while (0)

#define A2A_MPI_TYPE_CHECK(call) A2A_MPI_CHECK(call, "building an MPI datatype")

// The committed datatype of a span that MPI cannot take as a plain byte count
// (strided, or more bytes than max_count). The caller frees it.
MPI_Datatype span_type(const Span& span, size_t max_count, int rank);

// Paces the polls of one wait. Back to back for the first kSpinSeconds: a
// small exchange completes within them, and a yield costs a system call and
// possibly the core (measured in docs/benchmarks.md). Then a yield after each
// poll: with more ranks than cores (common in tests and on shared nodes) the
// peer this rank waits for needs the core. The clock is read every 16 polls.
class PollPacer {
 public:
  explicit PollPacer(double timeout_s)
      : start_(Clock::now()), deadline_(start_ + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double>(timeout_s))) {}
  // After a poll that found the wait unfinished: false once the timeout passed.
  bool keep_waiting() {
    if (yielding_) std::this_thread::yield();
    if ((++polls_ & 15) != 0) return true;
    const auto now = Clock::now();
    yielding_ = now - start_ > kSpin;
    return now <= deadline_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kSpin{1000};
  Clock::time_point start_, deadline_;
  unsigned polls_ = 0;
  bool yielding_ = false;
};

}  // namespace a2a
