/* nccl-tests' command line, as far as it applies to a2a's all-to-alls, plus
 * -a (algorithm), -D (host or CUDA buffers) and each test's own flags.
 * Flags that cannot apply are rejected with the reason. */
#ifndef NTE_OPTIONS_H_
#define NTE_OPTIONS_H_

#include <stdio.h>

#include "harness.h"

typedef struct {
  size_t min_bytes, max_bytes, step_bytes;
  long step_factor;
  long iters, warmup_iters, check, run_cycles;
  long blocking;       /* -z: 0 none, 1 wait + barrier after each call, 2 wait, 3 wait + barrier, barrier untimed */
  long graph_launches; /* -G */
  long report_cputime; /* -C */
  long unalign;        /* -u, elements */
  long average;        /* --average: 0 rank 0, 1 mean, 2 min, 3 max over ranks */
  long null_stream;    /* -y */
  double timeout_s;    /* -T; 0: A2A_TIMEOUT_S, else a2a's default */
  const nte_dtype* dtype; /* NULL: -d all */
  a2a_algo_t algo;
  nte_memory_kind memory;
} nte_options;

typedef enum { NTE_OPTIONS_RUN = 0, NTE_OPTIONS_HELP = 1, NTE_OPTIONS_ERROR = 2 } nte_options_result;

/* Parses argv into opts (every rank does the same). On NTE_OPTIONS_ERROR
 * the message is in err. */
nte_options_result nte_parse_options(const nte_test* test, int argc, char** argv, nte_options* opts, char* err,
                                     size_t err_size);

void nte_print_help(const nte_test* test, FILE* out);

#endif /* NTE_OPTIONS_H_ */
