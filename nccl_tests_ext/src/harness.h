/* What one benchmark program (alltoall_perf, alltoallv_perf,
 * alltoall_flex_perf) gives the shared harness: its name, its own flags,
 * and the calls that set up, run and check one size. The harness owns
 * everything else: MPI and the a2a communicator, nccl-tests' flags, the
 * sweep of sizes, timing, and the output in nccl-tests' format. */
#ifndef NTE_HARNESS_H_
#define NTE_HARNESS_H_

#include <a2a/a2a.h>
#include <stddef.h>
#include <stdint.h>

#include "memory.h"
#include "pattern.h"

/* What a test's calls see. */
typedef struct {
  a2a_comm_t comm;
  int rank;
  int size;
  a2a_algo_t algo;
  const nte_dtype* dtype;
  const nte_memory* mem;
  size_t unalign_bytes; /* -u, in bytes: every buffer starts this far into its allocation */
} nte_context;

/* The figures of one row, decided by the test for a requested size. */
typedef struct {
  size_t bytes;    /* the `size` column */
  size_t count;    /* the `count` column: elements per peer (for all-to-all-v, the mean) */
  double bw_bytes; /* the bytes algbw divides by the time */
} nte_sizes;

/* A flag of one test beyond nccl-tests' own. */
typedef struct {
  char short_name; /* 0: long name only */
  const char* long_name;
  const char* arg;  /* e.g. "<factor>" */
  const char* help; /* one line, with the default */
} nte_test_option;

typedef struct {
  const char* name;    /* the program, e.g. "alltoall_perf" */
  const char* summary; /* what it measures, for --help */
  const nte_test_option* options; /* ends with an entry whose long_name is NULL */
  /* Takes the value of one of `options` (by long name); returns 0, or -1
   * with a message in err. */
  int (*set_option)(const char* long_name, const char* value, char* err, size_t err_size);
  /* Why -G cannot capture this collective, or NULL when it can. */
  const char* no_graph_reason;
  /* Comment lines printed after the device list (rank 0 only; may be NULL). */
  void (*describe)(const nte_context* ctx);
  /* Allocates and sets up one size; returns the test's state. Collective. */
  void* (*prepare)(const nte_context* ctx, size_t requested_bytes, nte_sizes* sizes);
  /* Writes the data of check round `rep` and poisons the output. */
  void (*fill)(void* state, int rep);
  /* One collective call (on CUDA, enqueued on the stream). */
  void (*run)(void* state);
  /* Wrong elements of this rank's output after a call with the data of `rep`. */
  int64_t (*check)(void* state, int rep);
  void (*release)(void* state);
} nte_test;

/* Each program defines its test. NTE_TEST_CALLS fills in the five calls
 * from static functions of those names. */
#define NTE_TEST_CALLS .prepare = prepare, .fill = fill, .run = run, .check = check, .release = release
extern const nte_test nte_test_definition;

/* The buffers of one call: send and recv start -u elements into their
 * allocations, the workspace does not. */
typedef struct {
  nte_buffer send, recv, workspace;
} nte_call_buffers;

nte_call_buffers nte_alloc_call(const nte_context* ctx, size_t send_elements, size_t recv_elements,
                                size_t workspace_bytes);
/* Before a call: poisons recv on the host, then copies send (written on the
 * host by the test) and recv to the device. */
void nte_load_call(const nte_context* ctx, const nte_call_buffers* b);
/* After a call: copies recv to the host. */
void nte_fetch_result(const nte_context* ctx, const nte_call_buffers* b);
void nte_free_call(const nte_context* ctx, nte_call_buffers* b);

/* Elements per peer for `bytes` per rank, as nccl-tests' alltoall rounds
 * it: down to whole elements per rank, and to a multiple of 16 bytes per
 * peer. */
size_t nte_per_peer_count(size_t bytes, size_t element_size, int num_ranks);

/* Strict number parsing for the options: 0, or -1 with a message naming
 * the flag. */
int nte_parse_long(const char* flag, const char* text, long low, long high, long* out, char* err, size_t err_size);
int nte_parse_double(const char* flag, const char* text, double low, double* out, char* err, size_t err_size);

#endif /* NTE_HARNESS_H_ */
