/* alltoall_perf: a2a_all_to_all (MPI_Alltoall semantics) with -a linear or
 * 2dh. A row's size is what each rank sends (= receives): ranks x count
 * elements. */
#include <stdlib.h>

#include "fatal.h"
#include "harness.h"

typedef struct {
  const nte_context* ctx;
  size_t count; /* elements per peer */
  nte_call_buffers buf;
} state;

static void* prepare(const nte_context* ctx, size_t requested, nte_sizes* sizes) {
  state* s = calloc(1, sizeof *s);
  const size_t es = ctx->dtype->size, ranks = (size_t)ctx->size;
  s->ctx = ctx;
  s->count = nte_per_peer_count(requested, es, ctx->size);
  size_t workspace_bytes = 0;
  NTE_A2A(a2a_all_to_all_workspace_size(ctx->comm, s->count, ctx->dtype->a2a, ctx->algo, &workspace_bytes));
  s->buf = nte_alloc_call(ctx, ranks * s->count, ranks * s->count, workspace_bytes);
  sizes->bytes = ranks * s->count * es;
  sizes->count = s->count;
  sizes->bw_bytes = (double)sizes->bytes;
  return s;
}

static void fill(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  nte_fill_sent_blocks(s->buf.send.host, ctx->dtype->size, s->count, ctx->size, ctx->rank, rep);
  nte_load_call(ctx, &s->buf);
}

static void run(void* p) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  NTE_A2A(a2a_all_to_all(ctx->comm, s->buf.send.data, s->buf.recv.data, s->count, ctx->dtype->a2a, ctx->algo,
                         s->buf.workspace.data, s->buf.workspace.bytes));
}

static int64_t check(void* p, int rep) {
  state* s = p;
  const nte_context* ctx = s->ctx;
  nte_fetch_result(ctx, &s->buf);
  return nte_count_wrong_received_blocks(s->buf.recv.host, ctx->dtype->size, s->count, ctx->size, ctx->rank, rep);
}

static void release(void* p) {
  state* s = p;
  nte_free_call(s->ctx, &s->buf);
  free(s);
}

const nte_test nte_test_definition = {
    .name = "alltoall_perf",
    .summary = "a2a_all_to_all (MPI_Alltoall semantics): each rank sends `count` elements to every rank.",
    NTE_TEST_CALLS,
};
