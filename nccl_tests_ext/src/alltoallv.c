/* alltoallv_perf: a2a's all-to-all-v (MPI_Alltoallv semantics, the count
 * exchange built in) with uneven counts.
 *
 * Counts: every rank sends the same total, ranks x count elements, split
 * over its destinations in Zipf proportions: it ranks them in a seeded
 * random order of its own (--seed) and gives the k-th a share proportional
 * to 1 / (1 + k)^s (-s). -s 0 is the even all-to-all; the larger s, the more
 * of each rank's data goes to its favourite peers, and the more some ranks
 * receive (like tokens routed to popular experts). Every rank computes the
 * whole matrix from the seed, so it knows what it must receive.
 *
 * A row's size is what each rank sends (the same on every rank). algbw, as
 * in nccl-tests' alltoallv, divides the bytes of the busiest rank (the most
 * any rank sends or receives) by the time: the busiest rank bounds the call.
 * busbw = algbw x (ranks-1)/ranks as for alltoall.
 *
 * By default every call finds its counts (a2a_all_to_all_v_start, then
 * a2a_all_to_all_v_finish: one round on MPI with linear, a count exchange
 * first elsewhere), which is what a call with new counts costs; -P 1 makes
 * one plan per size before timing and reuses it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fatal.h"
#include "harness.h"

static double skew = 1.0;
static long seed = 1;
static long reuse_plan = 0;

/* splitmix64: a small, well-mixed generator that every rank runs alike. */
static uint64_t next_random(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* counts[dst] of what `src` sends out of `total` elements. `order` is
 * scratch for num_ranks ints. The shares are floored and the remainder (less
 * than num_ranks) goes one element each to the favourite destinations. */
static void send_counts(int src, int num_ranks, int64_t total, int64_t* counts, int* order) {
  uint64_t state = (uint64_t)seed * 0x100000001B3ull + (uint64_t)src;
  for (int i = 0; i < num_ranks; ++i) order[i] = i;
  for (int i = num_ranks - 1; i > 0; --i) { /* Fisher-Yates */
    const int j = (int)(next_random(&state) % (uint64_t)(i + 1));
    const int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  double weight_sum = 0.0;
  for (int k = 0; k < num_ranks; ++k) weight_sum += pow(1.0 + k, -skew);
  int64_t assigned = 0;
  for (int k = 0; k < num_ranks; ++k) {
    const int64_t share = (int64_t)floor((double)total * pow(1.0 + k, -skew) / weight_sum);
    counts[order[k]] = share;
    assigned += share;
  }
  for (int k = 0; assigned < total; k = (k + 1) % num_ranks, ++assigned) counts[order[k]] += 1;
}

/* Over the whole matrix, row by row: what every rank receives in all
 * (received, num_ranks entries) and, unless recv_counts is NULL, what `rank`
 * receives from each rank. */
static void receive_totals(int rank, int num_ranks, int64_t total, int64_t* received, int64_t* recv_counts) {
  int64_t* row = malloc((size_t)num_ranks * sizeof *row);
  int* order = malloc((size_t)num_ranks * sizeof *order);
  memset(received, 0, (size_t)num_ranks * sizeof *received);
  for (int src = 0; src < num_ranks; ++src) {
    send_counts(src, num_ranks, total, row, order);
    if (recv_counts) recv_counts[src] = row[rank];
    for (int dst = 0; dst < num_ranks; ++dst) received[dst] += row[dst];
  }
  free(row);
  free(order);
}

typedef struct {
  const nte_context* ctx;
  int64_t *send_counts, *recv_counts, *got_counts;
  size_t sent, received; /* elements */
  a2a_v_plan_t plan;     /* -P 1 only */
  nte_call_buffers buf;
} state;

static void* prepare(const nte_context* ctx, size_t requested, nte_sizes* sizes) {
  state* s = calloc(1, sizeof *s);
  const int ranks = ctx->size;
  const size_t es = ctx->dtype->size, count = nte_per_peer_count(requested, es, ranks);
  const int64_t total = (int64_t)(count * (size_t)ranks);
  s->ctx = ctx;
  s->send_counts = malloc((size_t)ranks * sizeof(int64_t));
  s->recv_counts = malloc((size_t)ranks * sizeof(int64_t));
  s->got_counts = malloc((size_t)ranks * sizeof(int64_t));
  int* order = malloc((size_t)ranks * sizeof *order);
  send_counts(ctx->rank, ranks, total, s->send_counts, order);
  free(order);
  int64_t* received = malloc((size_t)ranks * sizeof *received);
  receive_totals(ctx->rank, ranks, total, received, s->recv_counts);
  int64_t busiest = total; /* every rank sends `total` */
  for (int r = 0; r < ranks; ++r) busiest = received[r] > busiest ? received[r] : busiest;
  free(received);
  s->sent = (size_t)total;
  for (int r = 0; r < ranks; ++r) s->received += (size_t)s->recv_counts[r];

  /* A plan made here sizes the workspace; -P 1 keeps it for every call. */
  a2a_v_plan_t plan;
  size_t workspace_bytes = 0;
  NTE_A2A(a2a_v_plan_create(ctx->comm, s->send_counts, 1, ctx->dtype->a2a, ctx->algo, &plan));
  NTE_A2A(a2a_v_plan_workspace_size(plan, &workspace_bytes));
  if (reuse_plan)
    s->plan = plan;
  else
    NTE_A2A(a2a_v_plan_destroy(plan));
  s->buf = nte_alloc_call(ctx, s->sent, s->received, workspace_bytes);
  sizes->bytes = s->sent * es;
  sizes->count = count;
  sizes->bw_bytes = (double)((size_t)busiest * es);
  return s;
}

static void fill(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  nte_fill_sent(s->buf.send.host, ctx->dtype->size, s->send_counts, ctx->size, ctx->rank, rep);
  for (int r = 0; r < ctx->size; ++r) s->got_counts[r] = -1; /* a call that did not run shows */
  nte_load_call(ctx, &s->buf);
}

static void run(void* p) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  if (!s->plan) {
    a2a_v_exchange_t exchange;
    NTE_A2A(a2a_all_to_all_v_start(ctx->comm, s->buf.send.data, s->send_counts, 1, ctx->dtype->a2a, ctx->algo,
                                   s->got_counts, &exchange));
    NTE_A2A(a2a_all_to_all_v_finish(exchange, s->buf.recv.data, s->buf.workspace.data, s->buf.workspace.bytes));
    return;
  }
  NTE_A2A(a2a_all_to_all_v(s->plan, s->buf.send.data, s->buf.recv.data, s->buf.workspace.data, s->buf.workspace.bytes));
  NTE_A2A(a2a_v_plan_recv_counts(s->plan, s->got_counts));
}

/* A received count that differs from the expected one counts as one wrong
 * element, besides the elements it displaces. */
static int64_t check(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  int64_t wrong = 0;
  for (int r = 0; r < ctx->size; ++r) wrong += s->got_counts[r] != s->recv_counts[r];
  nte_fetch_result(ctx, &s->buf);
  return wrong +
         nte_count_wrong_received(s->buf.recv.host, ctx->dtype->size, s->recv_counts, ctx->size, ctx->rank, rep);
}

static void release(void* p) {
  state* s = p;
  if (s->plan) NTE_A2A(a2a_v_plan_destroy(s->plan));
  nte_free_call(s->ctx, &s->buf);
  free(s->send_counts);
  free(s->recv_counts);
  free(s->got_counts);
  free(s);
}

/* The receive load of each rank, as a multiple of the even share. */
static void describe(const nte_context* ctx) {
  const int ranks = ctx->size, shown = ranks < 16 ? ranks : 16;
  const int64_t total = (int64_t)ranks << 20;
  int64_t* received = malloc((size_t)ranks * sizeof *received);
  receive_totals(0, ranks, total, received, NULL);
  printf("# alltoallv: -s %g --seed %ld: each rank sends its k-th favourite peer (seeded order) a share ~ 1/(1+k)^%g "
         "of its data\n", skew, seed, skew);
  printf("# alltoallv: received / sent per rank:");
  for (int r = 0; r < shown; ++r) printf(" %.2f", (double)received[r] / (double)total);
  printf("%s\n", shown < ranks ? " ..." : "");
  printf("# alltoallv: size = bytes each rank sends; algbw = bytes of the busiest rank (sent or received) / time\n");
  printf("# alltoallv: %s\n", reuse_plan ? "one plan per size, reused by every call (-P 1)"
                                         : "every call finds its counts (a2a_all_to_all_v_start + _finish)");
  free(received);
}

static const nte_test_option options[] = {
    {'s', "skew", "<s>", "Zipf exponent of the per-peer shares; 0 = even (default 1)"},
    {0, "seed", "<n>", "seed of every rank's order of favourite peers (default 1)"},
    {'P', "reuse_plan", "<0/1>", "1: one plan per size, reused (no count exchange per call) (default 0)"},
    {0, NULL, NULL, NULL},
};

static int set_option(const char* long_name, const char* value, char* err, size_t err_size) {
  if (!strcmp(long_name, "skew")) return nte_parse_double("-s/--skew", value, 0.0, &skew, err, err_size);
  if (!strcmp(long_name, "seed")) return nte_parse_long("--seed", value, 0, 1L << 62, &seed, err, err_size);
  return nte_parse_long("-P/--reuse_plan", value, 0, 1, &reuse_plan, err, err_size);
}

const nte_test nte_test_definition = {
    .name = "alltoallv_perf",
    .summary = "a2a_all_to_all_v_start + _finish, or a reused plan (MPI_Alltoallv semantics) with uneven, seeded per-peer counts.",
    .options = options,
    .set_option = set_option,
    .no_graph_reason = "an all-to-all-v plan exchanges its counts on the host, which a CUDA graph cannot capture",
    .describe = describe,
    NTE_TEST_CALLS,
};
