/* Exchanges data with every rank through liba2a's C ABI and checks it.
 *
 *   mpirun -np 4 ./alltoall        (A2A_LOCAL_SIZE=2 emulates 2 nodes x 2)
 *
 * Prints one line per collective with its #wrong count, like nccl-tests, and
 * exits non-zero if anything is wrong. */
#include <a2a/a2a.h>
#include <mpi.h>
#include <math.h>
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
    /* What the call costs (a2a_counters): one exchange (2DH: two, inside the node then along the
     * rail), and no round for the cross-rank check, which travels in those exchanges' messages. */
    a2a_counters_t before = A2A_COUNTERS_INIT, after = A2A_COUNTERS_INIT;
    CHECK(a2a_counters(comm, &before));
    CHECK(a2a_all_to_all(comm, send, recv, count, A2A_FLOAT32, algos[a], workspace, workspace_bytes));
    CHECK(a2a_counters(comm, &after));
    const int64_t rounds = size == 1 ? 0 : algos[a] == A2A_ALGO_2DH && num_nodes > 1 && local_size > 1 ? 2 : 1;
    if (after.collectives - before.collectives != 1 || after.check_rounds != before.check_rounds ||
        after.data_rounds - before.data_rounds != rounds) {
      fprintf(stderr, "rank %d: a2a_all_to_all %s cost %lld round(s) and %lld check round(s), expected %lld and 0\n",
              rank, a ? "2dh" : "linear", (long long)(after.data_rounds - before.data_rounds),
              (long long)(after.check_rounds - before.check_rounds), (long long)rounds);
      ++failures;
    }
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

  /* The same counts found by the exchange itself (start, size recv, finish):
   * one round on MPI with linear, the counts first with 2dh. Then one
   * exchange dropped (its rows discarded, the other ranks complete), and a
   * call refused while an exchange is open. */
  for (int a = 0; a < 2; ++a) {
    a2a_v_exchange_t exchange;
    CHECK(a2a_all_to_all_v_start(comm, send, send_counts, 1, A2A_FLOAT32, algos[a], recv_counts, &exchange));
    size_t rows = 0, exchange_workspace_bytes = 0;
    for (int src = 0; src < size; ++src) rows += (size_t)recv_counts[src];
    CHECK(a2a_v_exchange_workspace_size(exchange, &exchange_workspace_bytes));
    float* rows_in = malloc(sizeof(float) * rows + 1);
    void* exchange_workspace = exchange_workspace_bytes ? malloc(exchange_workspace_bytes) : NULL;
    CHECK(a2a_all_to_all_v_finish(exchange, rows_in, exchange_workspace, exchange_workspace_bytes));
    long v_wrong = 0;
    for (int src = 0, at_row = 0; src < size; ++src) {
      v_wrong += recv_counts[src] != (src + rank) % 3;
      for (int64_t i = 0; i < recv_counts[src]; ++i) v_wrong += rows_in[at_row++] != value(src, rank, (size_t)i);
    }
    if (a == 0) {
      CHECK(a2a_all_to_all_v_start(comm, send, send_counts, 1, A2A_FLOAT32, algos[a], recv_counts, &exchange));
      const a2a_status_t busy = a2a_all_to_all(comm, send, recv, 1, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0);
      v_wrong += busy != A2A_ERROR_INVALID_ARGUMENT;
      if (rank == 0) printf("a call while an exchange is open: %s\n", a2a_get_last_error());
      CHECK(a2a_all_to_all_v_drop(exchange));
    }
    free(rows_in);
    free(exchange_workspace);
    MPI_Allreduce(MPI_IN_PLACE, &v_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0) printf("a2a_all_to_all_v_start/finish %-6s ranks %d  #wrong %ld\n", a ? "2dh" : "linear", size, v_wrong);
    failures += v_wrong;
  }

  /* Dense collectives: gather every rank's id, sum ranks in place, and keep
   * this rank's block of a reduce-scatter (block i of rank r holds r + i). */
  {
    int32_t mine = rank, sum = rank;
    int32_t* ids = malloc(sizeof(int32_t) * size);
    int32_t* blocks = malloc(sizeof(int32_t) * size);
    int32_t reduced = -1;
    for (int i = 0; i < size; ++i) blocks[i] = rank + i;
    CHECK(a2a_all_gather(comm, &mine, ids, 1, A2A_INT32));
    CHECK(a2a_all_reduce(comm, &sum, &sum, 1, A2A_INT32, A2A_SUM));
    CHECK(a2a_reduce_scatter(comm, blocks, &reduced, 1, A2A_INT32, A2A_MAX));
    long dense_wrong = sum != size * (size - 1) / 2;
    dense_wrong += reduced != (size - 1) + rank;
    for (int i = 0; i < size; ++i) dense_wrong += ids[i] != i;
    MPI_Allreduce(MPI_IN_PLACE, &dense_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0) printf("a2a_all_gather + all_reduce + reduce_scatter ranks %d  #wrong %ld\n", size, dense_wrong);
    failures += dense_wrong;
    free(ids);
    free(blocks);
  }

  /* Uneven dense collectives: rank i contributes i % 3 elements (rank 0 none),
   * all equal to i; in the reduce-scatter every rank sends its rank + j at
   * element j of every block, and keeps the maximum over ranks of its own.
   * Then counts that differ on the last rank fail every rank. */
  {
    int64_t* v_counts = malloc(sizeof(int64_t) * size);
    int64_t total = 0;
    for (int i = 0; i < size; ++i) total += v_counts[i] = i % 3;
    int32_t mine[2] = {rank, rank};
    /* One element more than the counts need: the differing counts below claim it. */
    int32_t* gathered = malloc(sizeof(int32_t) * ((size_t)total + 1));
    int32_t* blocks = malloc(sizeof(int32_t) * ((size_t)total + 1));
    int32_t reduced[2] = {-1, -1};
    for (int i = 0, at = 0; i < size; ++i)
      for (int64_t j = 0; j < v_counts[i]; ++j) blocks[at++] = rank + (int32_t)j;
    CHECK(a2a_all_gather_v(comm, mine, gathered, v_counts, A2A_INT32));
    CHECK(a2a_reduce_scatter_v(comm, blocks, reduced, v_counts, A2A_INT32, A2A_MAX));
    long v_wrong = 0;
    for (int i = 0, at = 0; i < size; ++i)
      for (int64_t j = 0; j < v_counts[i]; ++j) v_wrong += gathered[at++] != i;
    for (int64_t j = 0; j < v_counts[rank]; ++j) v_wrong += reduced[j] != size - 1 + (int32_t)j;
    if (size > 1) {
      if (rank == size - 1) v_counts[0] += 1;
      const a2a_status_t differ = a2a_all_gather_v(comm, mine, gathered, v_counts, A2A_INT32);
      v_wrong += differ != A2A_ERROR_MISMATCH;
      if (rank == 0) printf("differing counts rejected: %s\n", a2a_get_last_error());
    }
    MPI_Allreduce(MPI_IN_PLACE, &v_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0) printf("a2a_all_gather_v + reduce_scatter_v ranks %d  #wrong %ld\n", size, v_wrong);
    failures += v_wrong;
    free(v_counts);
    free(gathered);
    free(blocks);
  }

  /* An MoE layer with identity experts: route (capacity agreed across ranks,
   * nothing dropped), dispatch into (E, C, M), all-to-all to the experts' ranks
   * and back, combine with the gates. Then y[t] = (g0 + g1) * x[t], and the
   * gate gradient against the dispatched rows is |x[t]|^2. */
  {
    const int64_t experts = 2 * size, top_k = 2, model_dim = 5, tokens = 6 + rank;
    a2a_exec_t exec = A2A_EXEC_CPU_INIT;
    int32_t* indices = malloc(sizeof(int32_t) * tokens * top_k);
    float* gates = malloc(sizeof(float) * tokens * top_k);
    float* x = malloc(sizeof(float) * tokens * model_dim);
    for (int64_t t = 0; t < tokens; ++t) {
      indices[t * top_k] = (int32_t)((t + rank) % experts);
      indices[t * top_k + 1] = (int32_t)((3 * t + 1) % experts);
      if (indices[t * top_k + 1] == indices[t * top_k]) indices[t * top_k + 1] = (indices[t * top_k] + 1) % experts;
      gates[t * top_k] = 0.75f;
      gates[t * top_k + 1] = 0.25f;
      for (int64_t m = 0; m < model_dim; ++m) x[t * model_dim + m] = (float)(rank * 100 + t) + 0.5f * (float)m;
    }
    int64_t* locations = malloc(sizeof(int64_t) * tokens * top_k);
    int64_t* counts = malloc(sizeof(int64_t) * experts);
    int64_t* offsets = malloc(sizeof(int64_t) * (experts + 1));
    size_t route_bytes = 0;
    CHECK(a2a_route_workspace_size(&exec, tokens, top_k, experts, &route_bytes));
    void* route_workspace = malloc(route_bytes ? route_bytes : 1);
    a2a_route_info_t info;
    CHECK(a2a_route(&exec, comm, indices, A2A_INT32, tokens, top_k, experts, NULL, 0, 0.0, route_workspace,
                    route_bytes, locations, counts, offsets, &info));
    a2a_routing_t routing = {tokens, top_k, experts, indices, A2A_INT32, locations, counts, offsets,
                             info.capacity, info.num_rows};
    const size_t rows_elements = (size_t)(info.num_rows * model_dim);
    float* dispatched = malloc(sizeof(float) * rows_elements + 1);
    float* expert_in = malloc(sizeof(float) * rows_elements + 1);
    float* y = malloc(sizeof(float) * tokens * model_dim);
    float* grad_gates = malloc(sizeof(float) * tokens * top_k);
    CHECK(a2a_moe_dispatch(&exec, &routing, x, A2A_FLOAT32, model_dim, NULL, A2A_FLOAT32, dispatched));
    const size_t per_rank = rows_elements / size; /* 2 experts' rows go to each rank */
    CHECK(a2a_all_to_all(comm, dispatched, expert_in, per_rank, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0));
    CHECK(a2a_all_to_all(comm, expert_in, dispatched, per_rank, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0));
    CHECK(a2a_moe_combine(&exec, &routing, dispatched, A2A_FLOAT32, model_dim, gates, A2A_FLOAT32, y));
    CHECK(a2a_moe_gate_grad(&exec, &routing, x, dispatched, A2A_FLOAT32, model_dim, A2A_FLOAT32, grad_gates));
    long moe_wrong = info.num_dropped != 0;
    for (int64_t t = 0; t < tokens; ++t) {
      float norm = 0.0f;
      for (int64_t m = 0; m < model_dim; ++m) {
        const float v = x[t * model_dim + m];
        norm += v * v;
        moe_wrong += fabsf(y[t * model_dim + m] - v) > 1e-5f * fabsf(v);
      }
      for (int64_t j = 0; j < top_k; ++j) moe_wrong += fabsf(grad_gates[t * top_k + j] - norm) > 1e-4f * norm;
    }
    /* The same routing at its capacity without waiting for the device: the
     * same tables, and the dropped count read afterwards. */
    int64_t* fixed_tables = malloc(sizeof(int64_t) * (tokens * top_k + 2 * experts + 1));
    int64_t* fixed_counts = fixed_tables + tokens * top_k;
    int64_t* fixed_offsets = fixed_counts + experts;
    int64_t fixed_dropped = -1;
    CHECK(a2a_route_fixed(&exec, indices, A2A_INT32, tokens, top_k, experts, NULL, info.capacity, route_workspace,
                          route_bytes, fixed_tables, fixed_counts, fixed_offsets));
    CHECK(a2a_route_fixed_dropped(&exec, tokens, top_k, experts, route_workspace, route_bytes, &fixed_dropped));
    moe_wrong += fixed_dropped != info.num_dropped;
    moe_wrong += memcmp(fixed_tables, locations, sizeof(int64_t) * tokens * top_k) != 0;
    moe_wrong += memcmp(fixed_counts, counts, sizeof(int64_t) * experts) != 0;
    moe_wrong += memcmp(fixed_offsets, offsets, sizeof(int64_t) * (experts + 1)) != 0;
    /* The same route with the counts copied to the host as well (what the
     * route knew there after its wait: no second read of a device's counts);
     * a NULL host array is refused. */
    int64_t* host_counts = malloc(sizeof(int64_t) * experts);
    CHECK(a2a_route_host_counts(&exec, comm, indices, A2A_INT32, tokens, top_k, experts, NULL, 0, 0.0,
                                route_workspace, route_bytes, locations, counts, offsets, host_counts, &info));
    moe_wrong += memcmp(host_counts, counts, sizeof(int64_t) * experts) != 0;
    moe_wrong += a2a_route_host_counts(&exec, NULL, indices, A2A_INT32, tokens, top_k, experts, NULL, 0, 0.0,
                                       route_workspace, route_bytes, locations, counts, offsets, NULL,
                                       &info) != A2A_ERROR_INVALID_ARGUMENT;
    free(host_counts);
    /* An expert index out of range is reported with its position: at once by
     * a2a_route, by a2a_route_fixed_dropped after a2a_route_fixed. */
    indices[1] = (int32_t)experts;
    const a2a_status_t bad = a2a_route(&exec, NULL, indices, A2A_INT32, tokens, top_k, experts, NULL, 0, 0.0,
                                       route_workspace, route_bytes, locations, counts, offsets, &info);
    moe_wrong += bad != A2A_ERROR_INVALID_ARGUMENT;
    CHECK(a2a_route_fixed(&exec, indices, A2A_INT32, tokens, top_k, experts, NULL, 2, route_workspace, route_bytes,
                          fixed_tables, fixed_counts, fixed_offsets));
    moe_wrong += fixed_tables[1] != -1; /* not routed meanwhile */
    moe_wrong += a2a_route_fixed_dropped(&exec, tokens, top_k, experts, route_workspace, route_bytes,
                                         &fixed_dropped) != A2A_ERROR_INVALID_ARGUMENT;
    free(fixed_tables);
    MPI_Allreduce(MPI_IN_PLACE, &moe_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0)
      printf("a2a_route (and a2a_route_fixed) + dispatch + all_to_all + combine ranks %d  #wrong %ld\n", size,
             moe_wrong);
    if (rank == 0) printf("index out of range rejected: %s\n", a2a_get_last_error());
    failures += moe_wrong;
    free(indices); free(gates); free(x); free(locations); free(counts); free(offsets); free(route_workspace);
    free(dispatched); free(expert_in); free(y); free(grad_gates);
  }

  /* The expert-specific operators on this rank's tokens (no communication):
   * expert e's weight is (e + 1) * I, so the gated ESMM by token gives
   * y[t] = sum_j g_j (e_j + 1) x[t], and ESS the per-expert sums of x. */
  {
    const int64_t experts = 3, top_k = 2, dim = 4, tokens = 5 + rank, tile = 4;
    a2a_exec_t exec = A2A_EXEC_CPU_INIT;
    int64_t* indices = malloc(sizeof(int64_t) * tokens * top_k);
    float* gates = malloc(sizeof(float) * tokens * top_k);
    float* x = malloc(sizeof(float) * tokens * dim);
    float* w = calloc((size_t)(experts * dim * dim), sizeof(float));
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t i = 0; i < dim; ++i) w[(e * dim + i) * dim + i] = (float)(e + 1);
    for (int64_t t = 0; t < tokens; ++t) {
      indices[t * top_k] = t % experts;
      indices[t * top_k + 1] = t % 4 == 3 ? -1 : (t + 1) % experts; /* some second choices not routed */
      gates[t * top_k] = 0.5f;
      gates[t * top_k + 1] = 0.25f;
      for (int64_t m = 0; m < dim; ++m) x[t * dim + m] = (float)(rank + t) + 0.125f * (float)m;
    }
    int64_t max_slots = 0;
    size_t index_bytes = 0, esmm_bytes = 0;
    CHECK(a2a_es_index_capacity(tokens, top_k, experts, tile, &max_slots));
    CHECK(a2a_es_index_workspace_size(&exec, tokens, top_k, experts, &index_bytes));
    int64_t* slots = malloc(sizeof(int64_t) * max_slots);
    int64_t* starts = malloc(sizeof(int64_t) * (experts + 1));
    int64_t* counts = malloc(sizeof(int64_t) * experts);
    void* index_workspace = malloc(index_bytes);
    a2a_es_index_t index = {tokens, top_k, experts, tile, 0, slots, starts, counts};
    CHECK(a2a_es_index(&exec, indices, A2A_INT64, tokens, top_k, experts, tile, index_workspace, index_bytes, slots,
                       max_slots, starts, counts, &index.num_slots));
    CHECK(a2a_esmm_workspace_size(&index, A2A_ES_ROWS_TOKEN, dim, A2A_FLOAT32, &esmm_bytes));
    void* esmm_workspace = malloc(esmm_bytes);
    float* y = malloc(sizeof(float) * tokens * dim);
    float* sums = malloc(sizeof(float) * experts * dim);
    CHECK(a2a_esmm(&exec, &index, x, A2A_ES_ROWS_TOKEN, dim, w, A2A_ES_WEIGHT_NK, NULL, gates, A2A_FLOAT32,
                   A2A_FLOAT32, dim, y, A2A_ES_ROWS_TOKEN, esmm_workspace, esmm_bytes));
    CHECK(a2a_ess(&exec, &index, x, A2A_ES_ROWS_TOKEN, NULL, A2A_FLOAT32, A2A_FLOAT32, dim, sums));
    long es_wrong = index.num_slots % tile != 0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t m = 0; m < dim; ++m) {
        float scale = 0.0f;
        for (int64_t j = 0; j < top_k; ++j)
          if (indices[t * top_k + j] >= 0) scale += gates[t * top_k + j] * (float)(indices[t * top_k + j] + 1);
        es_wrong += fabsf(y[t * dim + m] - scale * x[t * dim + m]) > 1e-5f * fabsf(scale * x[t * dim + m]) + 1e-6f;
      }
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t m = 0; m < dim; ++m) {
        float want = 0.0f;
        for (int64_t c = 0; c < tokens * top_k; ++c)
          if (indices[c] == e) want += x[(c / top_k) * dim + m];
        es_wrong += fabsf(sums[e * dim + m] - want) > 1e-5f * fabsf(want);
      }
    /* An expert index out of range is reported with its position. */
    indices[3] = experts;
    es_wrong += a2a_es_index(&exec, indices, A2A_INT64, tokens, top_k, experts, tile, index_workspace, index_bytes,
                             slots, max_slots, starts, counts, &index.num_slots) != A2A_ERROR_INVALID_ARGUMENT;
    MPI_Allreduce(MPI_IN_PLACE, &es_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0) printf("a2a_es_index + esmm + ess ranks %d  #wrong %ld\n", size, es_wrong);
    if (rank == 0) printf("es_index out of range rejected: %s\n", a2a_get_last_error());
    failures += es_wrong;
    free(indices); free(gates); free(x); free(w); free(slots); free(starts); free(counts); free(index_workspace);
    free(esmm_workspace); free(y); free(sums);
  }

  /* Sub-communicators (MPI_Comm_split semantics): the even and the odd ranks,
   * each ordered from the highest rank down; with more than 2 ranks, rank 0
   * joins none. Then a negative color on the last rank fails on every rank. */
  {
    const int excluded = size > 2 ? 0 : -1;
    const int color = rank == excluded ? A2A_UNDEFINED : rank % 2;
    a2a_comm_t half = comm; /* overwritten: NULL for A2A_UNDEFINED */
    CHECK(a2a_comm_split(comm, color, -rank, &half));
    long split_wrong = 0;
    if (color == A2A_UNDEFINED) {
      split_wrong += half != NULL;
    } else {
      int half_rank, half_size, expected_rank = 0, expected_size = 0;
      int32_t mine = rank, sum = 0, expected_sum = 0;
      for (int r = 0; r < size; ++r) {
        if (r == excluded || r % 2 != color) continue;
        expected_size += 1;
        expected_rank += r > rank;
        expected_sum += r;
      }
      CHECK(a2a_comm_topology(half, &half_rank, &half_size, NULL, NULL, NULL, NULL));
      CHECK(a2a_all_reduce(half, &mine, &sum, 1, A2A_INT32, A2A_SUM));
      split_wrong += half_rank != expected_rank || half_size != expected_size || sum != expected_sum;
      CHECK(a2a_comm_destroy(half));
    }
    a2a_comm_t refused = comm;
    const a2a_status_t split_status = a2a_comm_split(comm, rank == size - 1 ? -2 : 0, 0, &refused);
    split_wrong += split_status != (rank == size - 1 ? A2A_ERROR_INVALID_ARGUMENT : A2A_ERROR_REMOTE);
    split_wrong += refused != NULL;
    if (rank == size - 1) printf("negative color rejected: %s\n", a2a_get_last_error());
    MPI_Allreduce(MPI_IN_PLACE, &split_wrong, 1, MPI_LONG, MPI_SUM, world);
    if (rank == 0) printf("a2a_comm_split + all_reduce ranks %d  #wrong %ld\n", size, split_wrong);
    failures += split_wrong;
  }

  /* Bad input is an error code and a message, never a crash. */
  a2a_status_t status = a2a_all_to_all(comm, send, send, count, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0);
  if (status != A2A_ERROR_INVALID_ARGUMENT) failures += 1;
  if (rank == 0) printf("in-place call rejected: %s: %s\n", a2a_status_string(status), a2a_get_last_error());

  /* A plan outlives its communicator only as a clear error. */
  a2a_v_plan_t orphan;
  CHECK(a2a_v_plan_create(comm, send_counts, 1, A2A_FLOAT32, A2A_ALGO_LINEAR, &orphan));
  CHECK(a2a_comm_destroy(comm));
  status = a2a_all_to_all_v(orphan, send, recv, NULL, 0);
  if (status != A2A_ERROR_INVALID_ARGUMENT) failures += 1;
  if (rank == 0) printf("plan after its communicator was destroyed: %s: %s\n", a2a_status_string(status), a2a_get_last_error());
  CHECK(a2a_v_plan_destroy(orphan));
  free(send_counts);
  free(recv_counts);
  free(send);
  free(recv);
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
