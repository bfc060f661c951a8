#define _GNU_SOURCE
#include "options.h"

#include <errno.h>
#include <stdarg.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* How a flag is treated. */
typedef enum {
  TAKEN,   /* nccl-tests' meaning (or a2a's, for -a and -D) */
  ONLY,    /* accepted with its only meaningful value (`only`), else rejected with `why` */
  REJECTED /* cannot apply to an a2a all-to-all: rejected with `why` */
} flag_kind;

typedef struct {
  char short_name; /* 0: long name only */
  const char* long_name;
  const char* arg;
  flag_kind kind;
  const char* help; /* TAKEN: what it does; ONLY / REJECTED: why */
  const char* only; /* ONLY: the accepted value */
} flag;

/* nccl-tests' flags in its order, then the two that are a2a's. Note -a:
 * nccl-tests' -a is --average; here -a picks the algorithm (linear or 2dh)
 * and --average keeps nccl-tests' meaning under its long name. nccl-tests'
 * -D (device implementation) is taken by -D host|cuda the same way. */
static const flag flags[] = {
    {'t', "nthreads", "<num threads>", ONLY, "one thread per process: start more ranks with mpirun", "1"},
    {'g', "ngpus", "<gpus per thread>", ONLY, "one GPU per rank (-D cuda): start one rank per GPU", "1"},
    {'b', "minbytes", "<min size in bytes>", TAKEN, "smallest size per rank, K/M/G suffixes (default 32M)", NULL},
    {'e', "maxbytes", "<max size in bytes>", TAKEN, "largest size per rank (default 32M)", NULL},
    {'i', "stepbytes", "<increment size>", TAKEN, "add this to the size when -f is 1 (default 1M)", NULL},
    {'f', "stepfactor", "<increment factor>", TAKEN, "multiply the size by this (default 1: use -i)", NULL},
    {'n', "iters", "<iteration count>", TAKEN, "timed calls per size (default 20)", NULL},
    {'m', "agg_iters", "<aggregated iteration count>", ONLY,
     "a2a's collectives are separate calls; they cannot be aggregated into one NCCL group", "1"},
    {'w', "warmup_iters", "<warmup iteration count>", TAKEN, "untimed calls before each size (default 1)", NULL},
    {'N', "run_cycles", "<cycle count>", TAKEN, "run and print the sweep this many times; 0 = forever (default 1)",
     NULL},
    {'p', "parallel_init", "<0/1>", ONLY, "there is one communicator per process, made by a2a_comm_create_mpi", "0"},
    {'c', "check", "<check iteration count>", TAKEN,
     "checked calls per size after timing; #wrong sums their wrong elements over ranks; 0 = none (default 1)",
     NULL},
    {'o', "op", "<op>", REJECTED, "an all-to-all has no reduction operation (the redop column reads none)", NULL},
    {'d', "datatype", "<nccltype/all>", TAKEN,
     "int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 f8e4m3 f8e5m2, or all (default float)",
     NULL},
    {'r', "root", "<root>", REJECTED, "an all-to-all has no root (the root column reads -1)", NULL},
    {'z', "blocking", "<0/1/2/3>", TAKEN,
     "0: calls back to back; 1: wait and barrier after each call; 2: wait after each call; 3: as 1, the barrier "
     "untimed (default 0)",
     NULL},
    {'y', "stream_null", "<0/1>", TAKEN, "-D cuda: run on the legacy default stream (default 0)", NULL},
    {'T', "timeout", "<time in seconds>", TAKEN,
     "bound on every wait (a2a's timeout_s; default A2A_TIMEOUT_S, else 300)", NULL},
    {'G', "cudagraph", "<num graph launches>", TAKEN,
     "-D cuda: capture the -n calls as a CUDA graph and launch it this many times (default 0)", NULL},
    {'C', "report_cputime", "<0/1>", TAKEN, "report the time to issue the calls, not to finish them (default 0)",
     NULL},
    {'S', "report_timestamps", "<0/1>", ONLY, "timestamps on result lines are not implemented", "0"},
    {'J', "output_file", "<file>", REJECTED,
     "JSON output is not implemented: parse the text output (python: a2a.bench.nccl_format)", NULL},
    {0, "average", "<0/1/2/3>", TAKEN,
     "time reported over ranks: 0 rank 0, 1 mean, 2 min, 3 max (default 1; nccl-tests' -a)", NULL},
    {'R', "local_register", "<0/1/2>", ONLY, "a2a registers no NCCL buffers", "0"},
    {'x', "cta_policy", "<0/1/2>", REJECTED, "a NCCL communicator setting; a2a creates its own communicator", NULL},
    {0, "device_implementation", "<number>", ONLY, "a2a runs NCCL's host API, not device kernels", "0"},
    {'V', "device_cta_count", "<number>", REJECTED, "for NCCL device kernels, which a2a does not use", NULL},
    {'M', "memory", "<0/1>", ONLY, "the GPU memory report is not implemented", "0"},
    {'u', "unalign", "<index of first element>", TAKEN, "start every buffer this many elements late (default 0)",
     NULL},
    {'I', "per_iter_timing", "<0/1>", ONLY, "per-iteration timing is not implemented", "0"},
    {'K', "per_iter_skip", "<count>", ONLY, "per-iteration timing is not implemented", "0"},
    {'a', "algorithm", "<linear/2dh>", TAKEN,
     "a2a's algorithm: linear (one exchange with every rank) or 2dh (intra-node, then inter-node) (default linear)",
     NULL},
    {'D', "device", "<host/cuda>", TAKEN,
     "host: host buffers over MPI; cuda: one GPU per rank (its index on its host, or the one GPU it sees), buffers "
     "over NCCL (default host)",
     NULL},
};
static const int num_flags = (int)(sizeof(flags) / sizeof(flags[0]));

static int fail(char* err, size_t err_size, const char* format, ...) __attribute__((format(printf, 3, 4)));
static int fail(char* err, size_t err_size, const char* format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(err, err_size, format, args);
  va_end(args);
  return -1;
}

int nte_parse_long(const char* flag_name, const char* text, long low, long high, long* out, char* err,
                   size_t err_size) {
  char* end = NULL;
  errno = 0;
  const long value = strtol(text, &end, 0);
  if (errno || end == text || *end != '\0' || value < low || value > high) {
    snprintf(err, err_size, "%s: expected an integer in [%ld, %ld], got '%s'", flag_name, low, high, text);
    return -1;
  }
  *out = value;
  return 0;
}

int nte_parse_double(const char* flag_name, const char* text, double low, double* out, char* err, size_t err_size) {
  char* end = NULL;
  errno = 0;
  const double value = strtod(text, &end);
  if (errno || end == text || *end != '\0' || !isfinite(value) || value < low) {
    snprintf(err, err_size, "%s: expected a number >= %g, got '%s'", flag_name, low, text);
    return -1;
  }
  *out = value;
  return 0;
}

/* nccl-tests' sizes: a number with an optional K, M or G (powers of 1024). */
static int parse_size(const char* flag_name, const char* text, size_t* out, char* err, size_t err_size) {
  char* end = NULL;
  errno = 0;
  double value = strtod(text, &end);
  if (!errno && end != text) {
    switch (*end) {
      case 'K': case 'k': value *= 1024.0; ++end; break;
      case 'M': case 'm': value *= 1024.0 * 1024.0; ++end; break;
      case 'G': case 'g': value *= 1024.0 * 1024.0 * 1024.0; ++end; break;
      default: break;
    }
  }
  if (errno || end == text || *end != '\0' || !(value >= 0.0) || value > 1e18) {
    snprintf(err, err_size, "%s: expected a size in bytes (with an optional K, M or G), got '%s'", flag_name, text);
    return -1;
  }
  *out = (size_t)value;
  return 0;
}

/* One of the table's flags, with its value. */
static int take_flag(const flag* f, const char* value, nte_options* o, char* err, size_t n) {
  char name[64];
  if (f->short_name)
    snprintf(name, sizeof name, "-%c/--%s", f->short_name, f->long_name);
  else
    snprintf(name, sizeof name, "--%s", f->long_name);
  if (f->kind == REJECTED) return fail(err, n, "%s does not apply: %s", name, f->help);
  if (f->kind == ONLY) {
    char* end = NULL;
    const long given = strtol(value, &end, 0);
    if (end == value || *end != '\0' || given != strtol(f->only, NULL, 10))
      return fail(err, n, "%s %s does not apply: %s (only %s is accepted)", name, value, f->help, f->only);
    return 0;
  }
  const char* key = f->long_name;
  if (!strcmp(key, "minbytes")) return parse_size(name, value, &o->min_bytes, err, n);
  if (!strcmp(key, "maxbytes")) return parse_size(name, value, &o->max_bytes, err, n);
  if (!strcmp(key, "stepbytes")) return parse_size(name, value, &o->step_bytes, err, n);
  if (!strcmp(key, "stepfactor")) return nte_parse_long(name, value, 1, 1L << 30, &o->step_factor, err, n);
  if (!strcmp(key, "iters")) return nte_parse_long(name, value, 1, 1L << 30, &o->iters, err, n);
  if (!strcmp(key, "warmup_iters")) return nte_parse_long(name, value, 0, 1L << 30, &o->warmup_iters, err, n);
  if (!strcmp(key, "run_cycles")) return nte_parse_long(name, value, 0, 1L << 30, &o->run_cycles, err, n);
  if (!strcmp(key, "check")) return nte_parse_long(name, value, 0, 1L << 30, &o->check, err, n);
  if (!strcmp(key, "blocking")) return nte_parse_long(name, value, 0, 3, &o->blocking, err, n);
  if (!strcmp(key, "stream_null")) return nte_parse_long(name, value, 0, 1, &o->null_stream, err, n);
  if (!strcmp(key, "cudagraph")) return nte_parse_long(name, value, 0, 1L << 30, &o->graph_launches, err, n);
  if (!strcmp(key, "report_cputime")) return nte_parse_long(name, value, 0, 1, &o->report_cputime, err, n);
  if (!strcmp(key, "average")) return nte_parse_long(name, value, 0, 3, &o->average, err, n);
  if (!strcmp(key, "unalign")) return nte_parse_long(name, value, 0, 1L << 20, &o->unalign, err, n);
  if (!strcmp(key, "timeout")) return nte_parse_double(name, value, 0.0, &o->timeout_s, err, n);
  if (!strcmp(key, "datatype")) {
    o->dtype = NULL;
    if (!strcasecmp(value, "all")) return 0;
    o->dtype = nte_find_dtype(value);
    return o->dtype ? 0 : fail(err, n, "%s: unknown datatype '%s'; see --help", name, value);
  }
  if (!strcmp(key, "algorithm")) {
    if (!strcasecmp(value, "linear")) o->algo = A2A_ALGO_LINEAR;
    else if (!strcasecmp(value, "2dh")) o->algo = A2A_ALGO_2DH;
    else if (strspn(value, "0123456789") == strlen(value))
      return fail(err, n, "%s %s: here -a is the algorithm (linear or 2dh); nccl-tests' -a (average) is --average",
                  name, value);
    else return fail(err, n, "%s: expected linear or 2dh, got '%s'", name, value);
    return 0;
  }
  if (!strcmp(key, "device")) {
    if (!strcasecmp(value, "host")) o->memory = NTE_HOST;
    else if (!strcasecmp(value, "cuda")) o->memory = NTE_CUDA;
    else if (strspn(value, "0123456789") == strlen(value))
      return fail(err, n, "%s %s: here -D picks host or cuda buffers; nccl-tests' -D (device implementation) does "
                          "not apply: a2a runs NCCL's host API", name, value);
    else return fail(err, n, "%s: expected host or cuda, got '%s'", name, value);
    return 0;
  }
  return fail(err, n, "internal: flag %s has no parser", name);
}

/* Rules between flags, checked once all are read. */
static int check_combinations(const nte_test* test, const nte_options* o, char* err, size_t n) {
  if (getenv("NCCL_TESTS_SPLIT") || getenv("NCCL_TESTS_SPLIT_MASK"))
    return fail(err, n, "NCCL_TESTS_SPLIT / NCCL_TESTS_SPLIT_MASK are not supported: every rank joins one "
                        "communicator; start separate jobs for separate groups");
  if (o->min_bytes > o->max_bytes) {
    snprintf(err, n, "invalid sizes: -b %zu is larger than -e %zu", o->min_bytes, o->max_bytes);
    return -1;
  }
  if (o->step_factor > 1 && o->min_bytes == 0 && o->max_bytes > 0)
    return fail(err, n, "-b must be positive with -f above 1 (0 times a factor stays 0)");
  if (o->step_factor <= 1 && o->step_bytes == 0 && o->max_bytes > o->min_bytes)
    return fail(err, n, "-i must be positive when -f is 1 (the size would never grow)");
  if (o->null_stream && o->memory != NTE_CUDA)
    return fail(err, n, "-y/--stream_null chooses a CUDA stream: it needs -D cuda");
  if (o->graph_launches > 0) {
    if (o->memory != NTE_CUDA) return fail(err, n, "-G/--cudagraph captures CUDA work: it needs -D cuda");
    if (test->no_graph_reason) return fail(err, n, "-G/--cudagraph: %s", test->no_graph_reason);
    if (o->blocking) return fail(err, n, "-G cannot be combined with -z: a capture cannot wait for the stream");
    if (o->null_stream) return fail(err, n, "-G cannot capture the legacy default stream (-y 1)");
  }
  return 0;
}

static void defaults(nte_options* o) {
  memset(o, 0, sizeof *o);
  o->min_bytes = o->max_bytes = 32u << 20;
  o->step_bytes = 1u << 20;
  o->step_factor = 1;
  o->iters = 20;
  o->warmup_iters = 1;
  o->check = 1;
  o->run_cycles = 1;
  o->average = 1;
  o->dtype = nte_find_dtype("float");
  o->algo = A2A_ALGO_LINEAR;
  o->memory = NTE_HOST;
}

nte_options_result nte_parse_options(const nte_test* test, int argc, char** argv, nte_options* opts, char* err,
                                     size_t err_size) {
  defaults(opts);
  int num_test = 0;
  while (test->options && test->options[num_test].long_name) ++num_test;
  struct option* longopts = calloc((size_t)(num_flags + num_test + 2), sizeof(struct option));
  char shortopts[256] = ":h";
  for (int i = 0; i < num_flags + num_test; ++i) {
    const int mine = i >= num_flags;
    const char short_name = mine ? test->options[i - num_flags].short_name : flags[i].short_name;
    longopts[i].name = mine ? test->options[i - num_flags].long_name : flags[i].long_name;
    longopts[i].has_arg = required_argument;
    longopts[i].val = 256 + i; /* the table index, whichever spelling was used */
    if (short_name) {
      const size_t at = strlen(shortopts);
      shortopts[at] = short_name;
      shortopts[at + 1] = ':';
      shortopts[at + 2] = '\0';
    }
  }
  longopts[num_flags + num_test] = (struct option){"help", no_argument, NULL, 'h'};

  nte_options_result result = NTE_OPTIONS_RUN;
  opterr = 0;
  optind = 1;
  for (;;) {
    const int c = getopt_long(argc, argv, shortopts, longopts, NULL);
    if (c == -1) break;
    if (c == 'h') {
      result = NTE_OPTIONS_HELP;
      break;
    }
    if (c == '?' || c == ':') {
      char spelled[3] = {'-', (char)optopt, '\0'};
      snprintf(err, err_size, "%s '%s'; see --help", c == ':' ? "missing value for" : "unknown option",
               optopt ? spelled : argv[optind - 1]);
      result = NTE_OPTIONS_ERROR;
      break;
    }
    int index = c - 256;
    if (index < 0) /* a short name: find its entry */
      for (index = 0; index < num_flags + num_test; ++index) {
        const char s = index >= num_flags ? test->options[index - num_flags].short_name : flags[index].short_name;
        if (s == c) break;
      }
    const int failed = index >= num_flags
                           ? test->set_option(test->options[index - num_flags].long_name, optarg, err, err_size)
                           : take_flag(&flags[index], optarg, opts, err, err_size);
    if (failed) {
      result = NTE_OPTIONS_ERROR;
      break;
    }
  }
  free(longopts);
  if (result == NTE_OPTIONS_RUN && optind < argc) {
    snprintf(err, err_size, "unexpected argument '%s'; see --help", argv[optind]);
    result = NTE_OPTIONS_ERROR;
  }
  if (result == NTE_OPTIONS_RUN && check_combinations(test, opts, err, err_size)) result = NTE_OPTIONS_ERROR;
  return result;
}

static void print_flag(FILE* out, char short_name, const char* long_name, const char* arg, const char* help) {
  char spelled[96];
  if (short_name)
    snprintf(spelled, sizeof spelled, "-%c,--%s %s", short_name, long_name, arg);
  else
    snprintf(spelled, sizeof spelled, "--%s %s", long_name, arg);
  fprintf(out, "  %-44s %s\n", spelled, help);
}

void nte_print_help(const nte_test* test, FILE* out) {
  fprintf(out,
          "USAGE: mpirun -np N %s [flags]\n\n%s\n\n"
          "Output, sizes and flags follow nccl-tests (alltoall_perf). One rank per process; with -D cuda one GPU\n"
          "per rank. The in-place columns stay empty: a2a's collectives are out of place.\n\n",
          test->name, test->summary);
  fprintf(out, "nccl-tests' flags:\n");
  for (int i = 0; i < num_flags; ++i)
    if (flags[i].kind == TAKEN && strcmp(flags[i].long_name, "algorithm") && strcmp(flags[i].long_name, "device"))
      print_flag(out, flags[i].short_name, flags[i].long_name, flags[i].arg, flags[i].help);
  fprintf(out, "\na2a's flags (-a and -D mean something else in nccl-tests: --average, --device_implementation):\n");
  for (int i = 0; i < num_flags; ++i)
    if (!strcmp(flags[i].long_name, "algorithm") || !strcmp(flags[i].long_name, "device"))
      print_flag(out, flags[i].short_name, flags[i].long_name, flags[i].arg, flags[i].help);
  if (test->options && test->options[0].long_name) {
    fprintf(out, "\n%s's flags:\n", test->name);
    for (const nte_test_option* t = test->options; t->long_name; ++t)
      print_flag(out, t->short_name, t->long_name, t->arg, t->help);
  }
  fprintf(out, "\nnccl-tests' flags that do not apply (rejected, or accepted only with the value shown):\n");
  for (int i = 0; i < num_flags; ++i) {
    if (flags[i].kind == TAKEN) continue;
    char why[256];
    if (flags[i].kind == ONLY)
      snprintf(why, sizeof why, "only %s: %s", flags[i].only, flags[i].help);
    else
      snprintf(why, sizeof why, "%s", flags[i].help);
    print_flag(out, flags[i].short_name, flags[i].long_name, flags[i].arg, why);
  }
  fprintf(out, "\n  -h,--help\n");
}
