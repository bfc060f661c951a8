/* main() of every program: MPI, the a2a communicator, the sweep, timing and
 * checking as nccl-tests does them (its src/common.cu), and the output. */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fatal.h"
#include "options.h"
#include "report.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

nte_call_buffers nte_alloc_call(const nte_context* ctx, size_t send_elements, size_t recv_elements,
                                size_t workspace_bytes) {
  const size_t es = ctx->dtype->size;
  nte_call_buffers b;
  b.send = nte_alloc(ctx->mem, send_elements * es, ctx->unalign_bytes);
  b.recv = nte_alloc(ctx->mem, recv_elements * es, ctx->unalign_bytes);
  b.workspace = nte_alloc(ctx->mem, workspace_bytes, 0);
  return b;
}

void nte_load_call(const nte_context* ctx, const nte_call_buffers* b) {
  nte_poison(b->recv.host, ctx->dtype->size, b->recv.bytes / ctx->dtype->size);
  nte_upload(ctx->mem, &b->send);
  nte_upload(ctx->mem, &b->recv);
}

void nte_fetch_result(const nte_context* ctx, const nte_call_buffers* b) { nte_download(ctx->mem, &b->recv); }

void nte_free_call(const nte_context* ctx, nte_call_buffers* b) {
  nte_free(ctx->mem, &b->send);
  nte_free(ctx->mem, &b->recv);
  nte_free(ctx->mem, &b->workspace);
}

size_t nte_per_peer_count(size_t bytes, size_t element_size, int num_ranks) {
  const size_t per_peer = bytes / element_size / (size_t)num_ranks;
  const size_t align = element_size < 16 ? 16 / element_size : 1;
  return per_peer - per_peer % align;
}

/* nccl-tests' --average: how one rank's time becomes the row's. */
static double over_ranks(double seconds, long average, int size) {
  switch (average) {
    case 0: MPI_Bcast(&seconds, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD); return seconds;
    case 2: MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD); return seconds;
    case 3: MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD); return seconds;
    default: MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD); return seconds / size;
  }
}

/* This rank's seconds per call of -n calls: until they finished (*done),
 * and until they were issued (*issued, -C). -z adds waits and barriers
 * between calls; with -z 3 the barriers are not timed. With -G the calls
 * are captured once and the graph is launched -G times. */
static void time_calls(const nte_test* test, void* state, const nte_options* o, const nte_memory* mem, double* done,
                       double* issued) {
  const double calls = (double)o->iters * (double)(o->graph_launches > 0 ? o->graph_launches : 1);
  double start, untimed = 0.0;
  if (o->graph_launches > 0) {
    nte_graph_begin(mem);
    for (long i = 0; i < o->iters; ++i) test->run(state);
    void* graph = nte_graph_end(mem);
    MPI_Barrier(MPI_COMM_WORLD);
    start = now_s();
    for (long g = 0; g < o->graph_launches; ++g) nte_graph_launch(mem, graph);
    *issued = (now_s() - start) / calls;
    nte_synchronize(mem);
    *done = (now_s() - start) / calls;
    nte_graph_destroy(graph);
    return;
  }
  start = now_s();
  for (long i = 0; i < o->iters; ++i) {
    test->run(state);
    if (o->blocking) nte_synchronize(mem);
    if (o->blocking == 1) MPI_Barrier(MPI_COMM_WORLD);
    if (o->blocking == 3) {
      const double before = now_s();
      MPI_Barrier(MPI_COMM_WORLD);
      untimed += now_s() - before;
    }
  }
  *issued = (now_s() - start - untimed) / calls;
  nte_synchronize(mem);
  *done = (now_s() - start - untimed) / calls;
}

typedef struct {
  int errors; /* results with wrong elements (each rank counts them, as nccl-tests does) */
  double busbw_sum;
  long results;
  int round; /* the last check round's data */
} totals;

/* One row: set up, warm up, time, check, print. */
static void bench_size(const nte_test* test, const nte_context* ctx, const nte_options* o, size_t requested,
                       totals* sum) {
  nte_sizes sizes;
  void* state = test->prepare(ctx, requested, &sizes);
  test->fill(state, 0);
  for (long i = 0; i < o->warmup_iters; ++i) test->run(state);
  test->run(state); /* one more call, waited for everywhere, before timing */
  nte_synchronize(ctx->mem);
  MPI_Barrier(MPI_COMM_WORLD);

  double done, issued;
  time_calls(test, state, o, ctx->mem, &done, &issued);
  done = over_ranks(done, o->average, ctx->size);
  issued = over_ranks(issued, o->average, ctx->size);
  const double algbw = done > 0.0 ? sizes.bw_bytes / 1.0e9 / done : 0.0;
  const double busbw = algbw * (double)(ctx->size - 1) / (double)ctx->size;
  MPI_Barrier(MPI_COMM_WORLD);

  long long wrong = 0;
  for (long c = 0; c < o->check; ++c) {
    const int rep = ++sum->round;
    test->fill(state, rep);
    test->run(state);
    nte_synchronize(ctx->mem);
    wrong = (long long)test->check(state, rep);
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (wrong) break;
  }
  sum->errors += o->check > 0 && wrong != 0;
  if (ctx->rank == 0)
    nte_report_row(sizes.bytes, sizes.count, ctx->dtype->name, 1e6 * (o->report_cputime ? issued : done), algbw,
                   busbw, o->check > 0, (int64_t)wrong);
  sum->busbw_sum += busbw;
  sum->results += 1;
  test->release(state);
}

/* Every rank's "#  Rank ..." line, gathered to rank 0 in rank order. */
static void report_ranks(const nte_memory* mem, int rank, int size, int node, int local_rank) {
  enum { kLine = 512 };
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  host[strcspn(host, ".")] = '\0'; /* the short name, as nccl-tests prints it */
  char where[64], fields[kLine - 64], line[kLine] = ""; /* zero-filled: all kLine bytes are sent */
  snprintf(where, sizeof where, "node %d local_rank %d", node, local_rank);
  nte_describe_device(mem, where, fields, sizeof fields);
  snprintf(line, sizeof line, "%s|%d|%s", host, (int)getpid(), fields);
  char* all = rank == 0 ? malloc((size_t)size * kLine) : NULL;
  MPI_Gather(line, kLine, MPI_CHAR, all, kLine, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  for (int r = 0; r < size; ++r) {
    char* entry = all + (size_t)r * kLine;
    char* pid = strchr(entry, '|');
    *pid++ = '\0';
    char* device = strchr(pid, '|');
    *device++ = '\0';
    nte_report_rank(r, atoi(pid), entry, device);
  }
  free(all);
}

/* The lines after the device list that say what a2a runs. */
static void report_setup(const nte_context* ctx, const nte_options* o, int local_size, int num_nodes) {
  printf("#\n# a2a: %d ranks = %d node%s x %d (local_size %s); algorithm %s; %s\n", ctx->size, num_nodes,
         num_nodes == 1 ? "" : "s", local_size, getenv("A2A_LOCAL_SIZE") ? "from A2A_LOCAL_SIZE" : "detected",
         ctx->algo == A2A_ALGO_2DH ? "2dh" : "linear",
         o->memory == NTE_CUDA ? "CUDA buffers over NCCL, one GPU per rank" : "host buffers over MPI");
  if (ctx->algo == A2A_ALGO_2DH && (num_nodes == 1 || local_size == 1))
    printf("# note: with one node or one rank per node, 2dh runs the linear exchange\n");
  printf("# in-place: not run (a2a's collectives are out of place), so the in-place columns are empty\n");
  static const char* how[] = {"rank 0's", "the mean over ranks of the", "the minimum over ranks of the",
                              "the maximum over ranks of the"};
  printf("# time: %s time of -n calls / n; busbw = algbw * (ranks-1)/ranks; GB = 1e9 B\n", how[o->average]);
}

static int has_nccl(void) {
  const char* config = a2a_build_config();
  return strstr(config, ";nccl=1") != NULL || strncmp(config, "nccl=1", 6) == 0;
}

int main(int argc, char** argv) {
  const nte_test* test = &nte_test_definition;
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  nte_fatal_context(test->name, rank);

  nte_options opts;
  char err[512] = "";
  const nte_options_result parsed = nte_parse_options(test, argc, argv, &opts, err, sizeof err);
  if (parsed != NTE_OPTIONS_RUN) {
    if (rank == 0 && parsed == NTE_OPTIONS_HELP) nte_print_help(test, stdout);
    if (rank == 0 && parsed == NTE_OPTIONS_ERROR) fprintf(stderr, "%s: %s\n", test->name, err);
    MPI_Finalize();
    return parsed == NTE_OPTIONS_HELP ? 0 : 2;
  }

  /* One GPU per rank: this rank's index among the ranks of its host. */
  MPI_Comm host_comm;
  int host_rank = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host_comm);
  MPI_Comm_rank(host_comm, &host_rank);
  MPI_Comm_free(&host_comm);
  const char* timeout_env = getenv("A2A_TIMEOUT_S");
  const double timeout_s = opts.timeout_s > 0 ? opts.timeout_s : timeout_env ? atof(timeout_env) : 300.0;
  nte_memory mem;
  int failed = 0;
  if (opts.memory == NTE_CUDA && !has_nccl()) {
    snprintf(err, sizeof err, "-D cuda needs liba2a built with NCCL (A2A_WITH_NCCL=1); this one is: %s",
             a2a_build_config());
    failed = 1;
  }
  if (!failed) failed = nte_memory_init(&mem, opts.memory, host_rank, (int)opts.null_stream, timeout_s, err,
                                        sizeof err) != 0;
  int any_failed = failed;
  MPI_Allreduce(MPI_IN_PLACE, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_failed) {
    if (failed) fprintf(stderr, "%s: rank %d: %s\n", test->name, rank, err);
    MPI_Finalize();
    return 1;
  }

  MPI_Comm world = MPI_COMM_WORLD;
  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  config.timeout_s = opts.timeout_s;
  if (opts.memory == NTE_CUDA) {
    config.device_type = A2A_DEVICE_CUDA;
    config.transport = A2A_TRANSPORT_NCCL;
    config.cuda_device = mem.device;
  }
  nte_context ctx = {NULL, 0, 0, opts.algo, NULL, &mem, 0};
  NTE_A2A(a2a_comm_create_mpi(&world, &config, &ctx.comm));
  if (opts.memory == NTE_CUDA) NTE_A2A(a2a_comm_set_stream(ctx.comm, mem.stream));
  int local_rank, local_size, node, num_nodes;
  NTE_A2A(a2a_comm_topology(ctx.comm, &ctx.rank, &ctx.size, &local_rank, &local_size, &node, &num_nodes));

  if (rank == 0) {
    printf("# nccl_tests_ext version %d.%d.%d liba2a: %s\n", A2A_VERSION_MAJOR, A2A_VERSION_MINOR, A2A_VERSION_PATCH,
           a2a_build_config());
    nte_report_start(test->name, &opts);
  }
  report_ranks(&mem, rank, size, node, local_rank);
  if (rank == 0) {
    report_setup(&ctx, &opts, local_size, num_nodes);
    if (test->describe) test->describe(&ctx);
    nte_report_columns(&opts);
  }

  totals sum = {0, 0.0, 0, 0};
  for (int t = 0; t < nte_num_dtypes; ++t) {
    if (opts.dtype && opts.dtype != &nte_dtypes[t]) continue;
    ctx.dtype = &nte_dtypes[t];
    ctx.unalign_bytes = (size_t)opts.unalign * ctx.dtype->size;
    for (long cycle = 0; opts.run_cycles == 0 || cycle < opts.run_cycles; ++cycle)
      for (size_t bytes = opts.min_bytes; bytes <= opts.max_bytes;) {
        bench_size(test, &ctx, &opts, bytes, &sum);
        const size_t next = opts.step_factor > 1 ? bytes * (size_t)opts.step_factor : bytes + opts.step_bytes;
        if (next <= bytes) break; /* -b 0 -e 0, or past SIZE_MAX */
        bytes = next;
      }
  }

  MPI_Allreduce(MPI_IN_PLACE, &sum.errors, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  int bw_failed = 0;
  if (rank == 0) bw_failed = nte_report_end(test->name, sum.errors, sum.busbw_sum / (double)sum.results);
  NTE_A2A(a2a_comm_destroy(ctx.comm));
  nte_memory_finalize(&mem);
  MPI_Finalize();
  return sum.errors || bw_failed ? 1 : 0;
}
