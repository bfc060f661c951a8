#include "setup/mpi_calls.hpp"

#include "core/error.hpp"
#include "core/poll.hpp"

namespace a2a {

void check_mpi(int rc, const char* call, int rank, const char* what) {
  if (rc != MPI_SUCCESS)
    fail(A2A_ERROR_TRANSPORT, rank >= 0 ? cat("rank ", rank, ": ") : std::string(), what, ": ", call, " failed: ",
         mpi_error_text(rc));
}

void wait_mpi(MPI_Request& request, const char* call, int rank, int size, double timeout_s, const char* what) {
  int done = 0;
  const bool finished = poll_until(timeout_s, [&] {
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test", rank, what);
    return done != 0;
  });
  if (!finished)
    fail(A2A_ERROR_TIMEOUT, "rank ", rank, " of ", size, ": timed out after ", timeout_s, " s (A2A_TIMEOUT_S) in ",
         what, " (", call, "); another rank did not create the communicator, died, or is stuck");
}

}  // namespace a2a
