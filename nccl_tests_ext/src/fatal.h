/* Failing loudly: every error names the program and the rank, then aborts
 * the whole job (one rank leaving alone would leave its peers waiting in a
 * collective). */
#ifndef NTE_FATAL_H_
#define NTE_FATAL_H_

#include <a2a/a2a.h>

/* Set once by main: the program name and this rank (-1 before MPI). */
void nte_fatal_context(const char* program, int rank);

/* Prints "<program>: rank <r>: <message>" on stderr and aborts MPI_COMM_WORLD. */
void nte_fatal(const char* format, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* An a2a call that must succeed: on failure its status and a2a's message. */
#define NTE_A2A(call)                                                                                 \
  do {                                                                                                \
    a2a_status_t nte_status_ = (call);                                                                \
    if (nte_status_ != A2A_SUCCESS)                                                                   \
      nte_fatal("%s failed (%s): %s", #call, a2a_status_string(nte_status_), a2a_get_last_error());   \
  } while (0)

#endif /* NTE_FATAL_H_ */
