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

/*
 * a2a_comm_create_external whose every checked call checks by a round of
 * its own before its data, as it did until 2026-11-30, instead of posting the
 * check of a predicted call beside the data: the measure of what the
 * predicted check saves over such a channel (tools/torchrun_check_cost.py).
 * Collective.
 */
A2A_API a2a_status_t a2a_testing_comm_create_external_by_round(const a2a_transport_ops_t* ops, int size, int rank,
                                                               const a2a_comm_config_t* config, a2a_comm_t* comm);

#ifdef __cplusplus
}
#endif

#endif /* A2A_A2A_TESTING_H_ */
