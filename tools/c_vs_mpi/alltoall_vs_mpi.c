/* a2a_all_to_all through the C ABI against MPI_Alltoall, in turns, in one
 * run: the C-level cost of the library's exchange and of its cross-rank
 * check, without Python (docs/benchmarks.md, "The check inside 2DH's own
 * messages"). Built and run by tools/c_vs_mpi/run.py.
 *
 *   mpirun -np 4 alltoall_vs_mpi ALGO MIN_BYTES MAX_BYTES CALLS REPETITIONS
 *
 * For each size (bytes one rank sends, doubling from MIN_BYTES), each
 * repetition times CALLS calls of a2a_all_to_all, then CALLS calls of
 * MPI_Alltoall, each block between barriers; rank 0 prints the medians of
 * the slowest rank's mean per call, and their ratio. A2A_CROSS_CHECK=0
 * turns the library's check off. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "a2a/a2a.h"

static void require(a2a_status_t status, const char* what) {
  if (status == A2A_SUCCESS) return;
  fprintf(stderr, "%s: %s\n", what, a2a_get_last_error());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

static int compare(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* The slowest rank's mean time per call of `calls` calls. */
static double timed(int ours, a2a_comm_t comm, const float* send, float* recv, size_t count, a2a_algo_t algo,
                    void* workspace, size_t workspace_bytes, int calls) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  for (int i = 0; i < calls; ++i) {
    if (ours)
      require(a2a_all_to_all(comm, send, recv, count, A2A_FLOAT32, algo, workspace, workspace_bytes), "a2a_all_to_all");
    else
      MPI_Alltoall(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
  }
  double mine = (MPI_Wtime() - start) / calls, slowest = 0.0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (argc != 6) {
    fprintf(stderr, "usage: alltoall_vs_mpi linear|2dh MIN_BYTES MAX_BYTES CALLS REPETITIONS\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const a2a_algo_t algo = strcmp(argv[1], "2dh") == 0 ? A2A_ALGO_2DH : A2A_ALGO_LINEAR;
  const size_t min_bytes = strtoull(argv[2], NULL, 10), max_bytes = strtoull(argv[3], NULL, 10);
  const int calls = atoi(argv[4]), repetitions = atoi(argv[5]);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm world = MPI_COMM_WORLD;
  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  a2a_comm_t comm = NULL;
  require(a2a_comm_create_mpi(&world, &config, &comm), "a2a_comm_create_mpi");
  int check = 1;
  require(a2a_comm_cross_check(comm, &check), "a2a_comm_cross_check");
  if (rank == 0)
    printf("# %s, %d ranks, cross-rank check %s; time per call in us (median of %d x %d calls)\n", argv[1], size,
           check ? "on" : "off", repetitions, calls);
  if (rank == 0) printf("%12s %12s %12s %8s\n", "bytes", "a2a", "MPI", "ratio");
  double* ours = malloc(sizeof(double) * (size_t)repetitions);
  double* theirs = malloc(sizeof(double) * (size_t)repetitions);
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const size_t count = bytes / sizeof(float) / (size_t)size;
    float* send = calloc(count * (size_t)size, sizeof(float));
    float* recv = calloc(count * (size_t)size, sizeof(float));
    size_t workspace_bytes = 0;
    require(a2a_all_to_all_workspace_size(comm, count, A2A_FLOAT32, algo, &workspace_bytes), "workspace size");
    void* workspace = workspace_bytes ? malloc(workspace_bytes) : NULL;
    timed(1, comm, send, recv, count, algo, workspace, workspace_bytes, calls);  /* warm-up */
    timed(0, comm, send, recv, count, algo, workspace, workspace_bytes, calls);
    for (int r = 0; r < repetitions; ++r) {
      ours[r] = timed(1, comm, send, recv, count, algo, workspace, workspace_bytes, calls);
      theirs[r] = timed(0, comm, send, recv, count, algo, workspace, workspace_bytes, calls);
    }
    qsort(ours, (size_t)repetitions, sizeof(double), compare);
    qsort(theirs, (size_t)repetitions, sizeof(double), compare);
    const double a = ours[repetitions / 2] * 1e6, m = theirs[repetitions / 2] * 1e6;
    if (rank == 0) printf("%12zu %12.2f %12.2f %8.2f\n", count * sizeof(float) * (size_t)size, a, m, a / m);
    free(send);
    free(recv);
    free(workspace);
  }
  free(ours);
  free(theirs);
  require(a2a_comm_destroy(comm), "a2a_comm_destroy");
  MPI_Finalize();
  return 0;
}
