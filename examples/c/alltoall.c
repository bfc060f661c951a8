/* Exchanges data with every rank through liba2a's C ABI and checks it.
 *
 *   mpirun -np 4 ./alltoall        (A2A_LOCAL_SIZE=2 emulates 2 nodes x 2)
 *
 * Prints one line per collective with its #wrong count, like nccl-tests, and
 * exits non-zero if anything is wrong. */
#include <a2a/a2a.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                   \
  do {                                                                                \
    a2a_status_t status_ = (call);                                                    \
    if (status_ != A2A_SUCCESS) {                                                     \
      fprintf(stderr, "%s failed (%s): %s\n", #call, a2a_status_string(status_),      \
              a2a_get_last_error());                                                  \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                   \
    }                                                                                 \
  } while (0)

/* The value rank `src` sends to rank `dst` at position i of the block. */
static float value(int src, int dst, size_t i) { return (float)(src * 1000 + dst * 10) + (float)(i % 7); }

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm world = MPI_COMM_WORLD;

  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  a2a_comm_t comm;
  CHECK(a2a_comm_create_mpi(&world, &config, &comm));
  int rank, size, local_size, num_nodes;
  CHECK(a2a_comm_topology(comm, &rank, &size, NULL, &local_size, NULL, &num_nodes));

  const size_t count = 1001; /* elements per peer: odd on purpose */
  float* send = malloc(sizeof(float) * count * size);
  float* recv = malloc(sizeof(float) * count * size);
  for (int dst = 0; dst < size; ++dst)
    for (size_t i = 0; i < count; ++i) send[dst * count + i] = value(rank, dst, i);

  long failures = 0;
  const a2a_algo_t algos[2] = {A2A_ALGO_LINEAR, A2A_ALGO_2DH};
  for (int a = 0; a < 2; ++a) {
    size_t workspace_bytes = 0;
    CHECK(a2a_all_to_all_workspace_size(comm, count, A2A_FLOAT32, algos[a], &workspace_bytes));
    void* workspace = workspace_bytes ? malloc(workspace_bytes) : NULL;
    CHECK(a2a_all_to_all(comm, send, recv, count, A2A_FLOAT32, algos[a], workspace, workspace_bytes));
    long wrong = 0;
    for (int src = 0; src < size; ++src)
      for (size_t i = 0; i < count; ++i) wrong += recv[src * count + i] != value(src, rank, i);
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0)
      printf("a2a_all_to_all %-6s ranks %d (%d x %d)  #wrong %ld\n", a ? "2dh" : "linear", size, num_nodes,
             local_size, wrong);
    failures += wrong;
    free(workspace);
  }

  /* Uneven: rank r sends (r + dst) % 3 elements to dst. */
  int64_t* send_counts = malloc(sizeof(int64_t) * size);
  int64_t* recv_counts = malloc(sizeof(int64_t) * size);
  size_t sent = 0;
  for (int dst = 0; dst < size; ++dst) {
    send_counts[dst] = (rank + dst) % 3;
    for (int64_t i = 0; i < send_counts[dst]; ++i) send[sent++] = value(rank, dst, (size_t)i);
  }
  a2a_v_plan_t plan;
  CHECK(a2a_v_plan_create(comm, send_counts, 1, A2A_FLOAT32, A2A_ALGO_LINEAR, &plan));
  CHECK(a2a_v_plan_recv_counts(plan, recv_counts));
  CHECK(a2a_all_to_all_v(plan, send, recv, NULL, 0));
  long wrong = 0;
  size_t at = 0;
  for (int src = 0; src < size; ++src) {
    wrong += recv_counts[src] != (src + rank) % 3;
    for (int64_t i = 0; i < recv_counts[src]; ++i) wrong += recv[at++] != value(src, rank, (size_t)i);
  }
  CHECK(a2a_v_plan_destroy(plan));
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, world);
  if (rank == 0) printf("a2a_all_to_all_v linear ranks %d  #wrong %ld\n", size, wrong);
  failures += wrong;

  /* Bad input is an error code and a message, never a crash. */
  a2a_status_t status = a2a_all_to_all(comm, send, send, count, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0);
  if (status != A2A_ERROR_INVALID_ARGUMENT) failures += 1;
  if (rank == 0) printf("in-place call rejected: %s: %s\n", a2a_status_string(status), a2a_get_last_error());

  free(send_counts);
  free(recv_counts);
  free(send);
  free(recv);
  CHECK(a2a_comm_destroy(comm));
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
