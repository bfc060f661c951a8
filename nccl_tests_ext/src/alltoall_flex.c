/* alltoall_flex_perf: a2a_all_to_all_flex (JAX's lax.all_to_all, tiled) on
 * the layouts of an MoE layer with E = ranks x experts_per_rank experts,
 * capacity C rows per expert, rows of M elements (W = ranks, e = E/W):
 *
 *   dispatch (-L dispatch): (E, C, M)    split_axis 0, concat_axis 1 -> (e, W*C, M)
 *     rank r's experts [d*e, (d+1)*e) go to rank d, which lays the ranks'
 *     rows side by side: out[j, s*C + c, m] = rank s's in[r*e + j, c, m].
 *   combine (-L combine):  (e, W*C, M)  split_axis 1, concat_axis 0 -> (E, C, M)
 *     the way back: rank d's out[s*e + j, c, m] = rank s's in[j, d*C + c, m].
 *
 * For a requested size per rank, M = min(-H, what fits) and C is the largest
 * capacity that fits; the size column is the E*C*M elements each rank sends
 * (= receives), count the e*C*M elements per peer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fatal.h"
#include "harness.h"

static long experts_per_rank = 2;
static long hidden = 1024;
static int combine = 0;

typedef struct {
  const nte_context* ctx;
  size_t capacity, model_dim;
  size_t block; /* e*C*M: the elements between two ranks */
  int64_t in_shape[3], out_shape[3];
  int split_axis, concat_axis;
  nte_call_buffers buf;
} state;

static void* prepare(const nte_context* ctx, size_t requested, nte_sizes* sizes) {
  state* s = calloc(1, sizeof *s);
  const size_t es = ctx->dtype->size, ranks = (size_t)ctx->size, per_rank = (size_t)experts_per_rank;
  const size_t per_expert = nte_per_peer_count(requested, es, ctx->size) / per_rank;
  s->ctx = ctx;
  s->model_dim = per_expert < (size_t)hidden ? (per_expert ? per_expert : 1) : (size_t)hidden;
  s->capacity = per_expert / s->model_dim;
  const size_t block = per_rank * s->capacity * s->model_dim;
  s->block = block;
  const int64_t experts_shape[3] = {(int64_t)(ranks * per_rank), (int64_t)s->capacity, (int64_t)s->model_dim};
  const int64_t dispatched_shape[3] = {(int64_t)per_rank, (int64_t)(ranks * s->capacity), (int64_t)s->model_dim};
  memcpy(s->in_shape, combine ? dispatched_shape : experts_shape, sizeof s->in_shape);
  memcpy(s->out_shape, combine ? experts_shape : dispatched_shape, sizeof s->out_shape);
  s->split_axis = combine ? 1 : 0;
  s->concat_axis = combine ? 0 : 1;
  size_t workspace_bytes = 0;
  NTE_A2A(a2a_all_to_all_flex_workspace_size(ctx->comm, s->in_shape, 3, s->split_axis, s->concat_axis,
                                             ctx->dtype->a2a, ctx->algo, &workspace_bytes));
  s->buf = nte_alloc_call(ctx, ranks * block, ranks * block, workspace_bytes);
  sizes->bytes = ranks * block * es;
  sizes->count = block;
  sizes->bw_bytes = (double)sizes->bytes;
  return s;
}

/* The (e, W*C, M) side: the C*M elements at [j, p*C, 0] are elements
 * [j*C*M, (j+1)*C*M) of the block between this rank and rank p. Writes them
 * (what this rank sends p) or counts the wrong ones (what p sent this rank). */
static int64_t dispatched_side(state* s, void* buf, int rep, int write) {
  const nte_context* ctx = s->ctx;
  const size_t es = ctx->dtype->size, piece = s->capacity * s->model_dim;
  int64_t wrong = 0;
  for (long j = 0; j < experts_per_rank; ++j)
    for (int p = 0; p < ctx->size; ++p) {
      unsigned char* at = (unsigned char*)buf + ((size_t)j * (size_t)ctx->size + (size_t)p) * piece * es;
      if (write)
        nte_fill(at, es, piece, ctx->rank, p, (uint64_t)j * piece, rep);
      else
        wrong += nte_count_wrong(at, es, piece, p, ctx->rank, (uint64_t)j * piece, rep);
    }
  return wrong;
}

static void fill(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  if (combine)
    dispatched_side(s, s->buf.send.host, rep, 1);
  else
    nte_fill_sent_blocks(s->buf.send.host, ctx->dtype->size, s->block, ctx->size, ctx->rank, rep);
  nte_load_call(ctx, &s->buf);
}

static void run(void* p) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  NTE_A2A(a2a_all_to_all_flex(ctx->comm, s->buf.send.data, s->buf.recv.data, s->in_shape, 3, s->split_axis,
                              s->concat_axis, ctx->dtype->a2a, ctx->algo, s->buf.workspace.data,
                              s->buf.workspace.bytes));
}

static int64_t check(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  nte_fetch_result(ctx, &s->buf);
  if (!combine) return dispatched_side(s, s->buf.recv.host, rep, 0);
  return nte_count_wrong_received_blocks(s->buf.recv.host, ctx->dtype->size, s->block, ctx->size, ctx->rank, rep);
}

static void release(void* p) {
  state* s = p;
  nte_free_call(s->ctx, &s->buf);
  free(s);
}

static void describe(const nte_context* ctx) {
  const long experts = (long)ctx->size * experts_per_rank;
  if (combine)
    printf("# alltoall_flex: combine (%ld, %d*C, M) split_axis 1 concat_axis 0 -> (%ld, C, M)\n", experts_per_rank,
           ctx->size, experts);
  else
    printf("# alltoall_flex: dispatch (%ld, C, M) split_axis 0 concat_axis 1 -> (%ld, %d*C, M)\n", experts,
           experts_per_rank, ctx->size);
  printf("# alltoall_flex: E = %ld experts (%ld per rank), M = min(%ld, what fits), C = the capacity that fills the "
         "size\n", experts, experts_per_rank, hidden);
}

static const nte_test_option options[] = {
    {'E', "experts_per_rank", "<n>", "experts per rank; E = ranks x n (default 2)"},
    {'H', "hidden", "<M>", "elements per row (model dim), less when the size is small (default 1024)"},
    {'L', "layout", "<dispatch/combine>",
     "dispatch: (E,C,M) -> (E/W,W*C,M); combine: the way back (default dispatch)"},
    {0, NULL, NULL, NULL},
};

static int set_option(const char* long_name, const char* value, char* err, size_t err_size) {
  if (!strcmp(long_name, "experts_per_rank"))
    return nte_parse_long("-E/--experts_per_rank", value, 1, 1L << 20, &experts_per_rank, err, err_size);
  if (!strcmp(long_name, "hidden")) return nte_parse_long("-H/--hidden", value, 1, 1L << 30, &hidden, err, err_size);
  if (strcmp(value, "dispatch") && strcmp(value, "combine")) {
    snprintf(err, err_size, "-L/--layout: expected dispatch or combine, got '%s'", value);
    return -1;
  }
  combine = !strcmp(value, "combine");
  return 0;
}

const nte_test nte_test_definition = {
    .name = "alltoall_flex_perf",
    .summary = "a2a_all_to_all_flex on the MoE dispatch (E,C,M) -> (E/W,W*C,M) or combine (the way back) layouts.",
    .options = options,
    .set_option = set_option,
    .describe = describe,
    NTE_TEST_CALLS,
};
