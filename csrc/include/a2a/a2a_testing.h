/*
 * Entry points for a2a's own tests. Not installed and not part of the ABI:
 * they may change or go away in any release.
 */
#ifndef A2A_A2A_TESTING_H_
#define A2A_A2A_TESTING_H_

#include "a2a/a2a.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Like a2a_comm_create_mpi for a host communicator, with the data
 * (staging = "staged") or the control values (staging = "control") moved
 * through the staging transports that CUDA communicators use, with host
 * copies: the CPU test suite runs that code this way (A2A_TEST_STAGING in
 * tests/run_mpi.py). Collective.
 */
A2A_API a2a_status_t a2a_testing_comm_create_mpi(const void* mpi_comm, const a2a_comm_config_t* config,
                                                 const char* staging, a2a_comm_t* comm);

#ifdef __cplusplus
}
#endif

#endif /* A2A_A2A_TESTING_H_ */
