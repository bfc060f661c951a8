/* A decoding step's MoE exchange through liba2a's C ABI: tokens quantized to
 * FP8 rows with block scales (a2a_quantize_fp8 into packed rows), sent to
 * their experts with the low-latency dispatch, each expert scaling its rows,
 * and brought back with the gates by the low-latency combine. Checks the
 * result against the same sum computed here, and prints #wrong.
 *
 *   mpirun -np 4 ./low_latency */
#include <a2a/a2a.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                   \
  do {                                                                                \
    a2a_status_t status_ = (call);                                                    \
    if (status_ != A2A_SUCCESS) {                                                     \
      fprintf(stderr, "%s failed (%s): %s\n", #call, a2a_status_string(status_),      \
              a2a_get_last_error());                                                  \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                   \
    }                                                                                 \
  } while (0)

enum { M = 200, BLOCK = 128, TOP_K = 2, MAX_TOKENS = 8, EXPERTS_PER_RANK = 2 };

/* A value of token t of rank r, channel i: 0, +-0.5, +-1 or +-2, whose ratios are powers of two, so
 * that the FP8 round trip of any block is exact (and so are the sums). */
static float token_value(int r, int t, int i) {
  static const float values[7] = {0.0f, 0.5f, -0.5f, 1.0f, -1.0f, 2.0f, -2.0f};
  return values[(r * 7 + t * 3 + i) % 7];
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm world = MPI_COMM_WORLD;
  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  a2a_comm_t comm;
  CHECK(a2a_comm_create_mpi(&world, &config, &comm));
  int rank, size;
  CHECK(a2a_comm_topology(comm, &rank, &size, NULL, NULL, NULL, NULL));
  const int experts = EXPERTS_PER_RANK * size, tokens = 1 + rank % MAX_TOKENS;

  /* The tokens, as packed FP8 rows: [M codes | scales] per row. */
  int64_t scale_offset = 0, row_bytes = 0;
  CHECK(a2a_fp8_packed_layout(M, BLOCK, &scale_offset, &row_bytes));
  float* x = malloc(sizeof(float) * tokens * M);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < M; ++i) x[t * M + i] = token_value(rank, t, i);
  unsigned char* packed = calloc((size_t)tokens, (size_t)row_bytes);
  a2a_fp8_rows_t rows = {tokens, M, BLOCK, A2A_FP8_E4M3, packed, row_bytes,
                         (float*)(packed + scale_offset), row_bytes / 4};
  a2a_exec_t exec = A2A_EXEC_CPU_INIT;
  CHECK(a2a_quantize_fp8(&exec, x, A2A_FLOAT32, &rows));

  int64_t indices[MAX_TOKENS * TOP_K];
  float gates[MAX_TOKENS * TOP_K];
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < TOP_K; ++j) {
      indices[t * TOP_K + j] = (rank + t + 5 * j) % experts;
      gates[t * TOP_K + j] = 0.25f * (float)(j + 1);
    }

  a2a_low_latency_config_t ll = A2A_LOW_LATENCY_CONFIG_INIT;
  ll.max_tokens = MAX_TOKENS;
  ll.num_experts = experts;
  ll.top_k = TOP_K;
  ll.row_bytes = row_bytes;
  ll.model_dim = M;
  ll.dtype = A2A_FLOAT32;
  a2a_low_latency_t handle;
  CHECK(a2a_low_latency_create(comm, &ll, &handle));
  size_t workspace_bytes = 0;
  int64_t capacity = 0;
  CHECK(a2a_low_latency_workspace_size(handle, &workspace_bytes));
  CHECK(a2a_low_latency_expert_capacity(handle, &capacity));
  void* workspace = calloc(1, workspace_bytes);
  unsigned char* recv = calloc((size_t)(EXPERTS_PER_RANK * capacity), (size_t)row_bytes);
  int64_t counts[EXPERTS_PER_RANK];
  CHECK(a2a_low_latency_dispatch(handle, &exec, workspace, workspace_bytes, packed, tokens, indices, A2A_INT64,
                                 recv, counts));

  /* Expert e (global id g): dequantized rows times (g + 1). */
  float* expert_out = calloc((size_t)(EXPERTS_PER_RANK * capacity * M), sizeof(float));
  for (int e = 0; e < EXPERTS_PER_RANK; ++e) {
    a2a_fp8_rows_t arrived = {counts[e], M, BLOCK, A2A_FP8_E4M3, recv + e * capacity * row_bytes, row_bytes,
                              (float*)(recv + e * capacity * row_bytes + scale_offset), row_bytes / 4};
    float* out = expert_out + e * capacity * M;
    CHECK(a2a_dequantize_fp8(&exec, &arrived, A2A_FLOAT32, out));
    for (int64_t i = 0; i < counts[e] * M; ++i) out[i] *= (float)(rank * EXPERTS_PER_RANK + e + 1);
  }
  float* y = malloc(sizeof(float) * tokens * M);
  CHECK(a2a_low_latency_combine(handle, &exec, workspace, workspace_bytes, expert_out, gates, A2A_FLOAT32, y));

  long wrong = 0;
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < M; ++i) {
      float want = 0.0f;
      for (int j = 0; j < TOP_K; ++j) want += gates[t * TOP_K + j] * (float)(indices[t * TOP_K + j] + 1) * x[t * M + i];
      wrong += fabsf(y[t * M + i] - want) > 1e-5f * fabsf(want);
    }
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, world);
  if (rank == 0) printf("a2a_low_latency FP8 dispatch + combine, ranks %d  #wrong %ld\n", size, wrong);

  CHECK(a2a_low_latency_destroy(handle));
  CHECK(a2a_comm_destroy(comm));
  free(x), free(packed), free(workspace), free(recv), free(expert_out), free(y);
  MPI_Finalize();
  return wrong == 0 ? 0 : 1;
}
