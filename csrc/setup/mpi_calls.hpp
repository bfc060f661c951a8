// The MPI calls of communicator creation, checked and, where MPI offers a
// nonblocking form, bounded by the timeout: an MPI error becomes
// A2A_ERROR_TRANSPORT naming the call and the rank, a wait past the timeout
// A2A_ERROR_TIMEOUT. (The collectives' own calls are MpiTransport's.)
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "cpu/mpi_util.hpp"  // mpi_error_text

namespace a2a {

// Fails with A2A_ERROR_TRANSPORT ("rank R: <what>: <call> failed: <MPI's
// text>") unless rc is MPI_SUCCESS. rank < 0: not known yet.
void check_mpi(int rc, const char* call, int rank, const char* what);

// Polls a nonblocking collective's request until it completes, or fails
// with A2A_ERROR_TIMEOUT after timeout_s. The request of a timed-out
// collective is left active (MPI forbids freeing it); the caller abandons
// the communicators involved.
void wait_mpi(MPI_Request& request, const char* call, int rank, int size, double timeout_s, const char* what);

// wait_mpi for a call whose buffers (or output handle) are in `storage`:
// when the wait fails, the call may still write there later, so `storage`
// is leaked rather than freed.
template <typename T>
void wait_mpi(MPI_Request& request, const char* call, int rank, int size, double timeout_s, const char* what,
              std::unique_ptr<T>& storage) {
  try {
    wait_mpi(request, call, rank, size, timeout_s, what);
  } catch (...) {
    (void)storage.release();
    throw;
  }
}

}  // namespace a2a
