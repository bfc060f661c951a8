#include "fatal.h"

#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static const char* fatal_program = "nccl_tests_ext";
static int fatal_rank = -1;

void nte_fatal_context(const char* program, int rank) {
  fatal_program = program;
  fatal_rank = rank;
}

void nte_fatal(const char* format, ...) {
  fflush(stdout);
  fprintf(stderr, "%s: rank %d: ", fatal_program, fatal_rank);
  va_list args;
  va_start(args, format);
  vfprintf(stderr, format, args);
  va_end(args);
  fputc('\n', stderr);
  fflush(stderr);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, 1);
  exit(1);
}
