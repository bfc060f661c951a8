#include "report.h"

#include <stdio.h>
#include <stdlib.h>

/* nccl-tests' number cells: two decimals when they fit the width, then one,
 * then none, then an exponent. */
static void cell(double value, int width, char* out) {
  if (snprintf(out, (size_t)width + 1, "%*.2f", width, value) <= width) return;
  if (snprintf(out, (size_t)width + 1, "%*.1f", width, value) <= width) return;
  if (snprintf(out, (size_t)width + 1, "%*.0f", width, value) <= width) return;
  snprintf(out, (size_t)width + 1, width >= 7 ? "%*.1e" : "%*.0e", width, value);
}

void nte_report_start(const char* program, const nte_options* opts) {
  printf("# Collective test starting: %s\n", program);
  const int factor = opts->step_factor > 1;
  printf("# nThread 1 nGpus %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %ld iters: %ld agg iters: 1 "
         "validation: %ld graph: %ld unalign: %ld\n",
         opts->memory == NTE_CUDA ? 1 : 0, opts->min_bytes, opts->max_bytes,
         factor ? (size_t)opts->step_factor : opts->step_bytes, factor ? "factor" : "bytes", opts->warmup_iters,
         opts->iters, opts->check, opts->graph_launches, opts->unalign);
  if (opts->blocking == 1) printf("# Blocking Enabled: wait and barrier after each inner iteration (-m) \n");
  if (opts->blocking == 2) printf("# Blocking Enabled: wait after each inner iteration (-m), no barrier \n");
  if (opts->blocking == 3)
    printf("# Blocking Enabled: wait and barrier after each outer iteration (-n); time excludes barrier \n");
  printf("#\n# Using devices\n");
}

void nte_report_rank(int rank, int pid, const char* host, const char* device_fields) {
  printf("#  Rank %2d Group %2d Pid %6d on %10s %s\n", rank, 0, pid, host, device_fields);
}

void nte_report_columns(const nte_options* opts) {
  const char* time = opts->report_cputime ? "cputime" : "time";
  printf("#\n");
  printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n", "", "", "",
         "", "");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n", "size", "count", "type", "redop",
         "root", time, "algbw", "busbw", "#wrong", time, "algbw", "busbw", "#wrong");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n", "(B)", "(elements)", "", "", "",
         "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
}

void nte_report_row(size_t bytes, size_t count, const char* type, double time_us, double algbw, double busbw,
                    int report_errors, int64_t wrong) {
  char time_text[8], algbw_text[7], busbw_text[7];
  cell(time_us, 7, time_text);
  cell(algbw, 6, algbw_text);
  cell(busbw, 6, busbw_text);
  printf("%12zu  %12zu  %8s  %6s  %6i", bytes, count, type, "none", -1);
  if (report_errors)
    printf("  %7s  %6s  %6s  %6g\n", time_text, algbw_text, busbw_text, (double)wrong);
  else
    printf("  %7s  %6s  %6s    N/A\n", time_text, algbw_text, busbw_text);
  fflush(stdout);
}

int nte_report_end(const char* program, int errors, double avg_busbw) {
  const char* min_text = getenv("NCCL_TESTS_MIN_BW");
  const double min_bw = min_text ? atof(min_text) : -1.0;
  const int bw_failed = min_text && avg_busbw < 0.9 * min_bw;
  printf("# %-20s : %d %s\n", "Out of bounds values", errors, errors ? "FAILED" : "OK");
  printf("# %-20s : %g %s\n", "Avg bus bandwidth", avg_busbw, !min_text ? "" : bw_failed ? "FAILED" : "OK");
  printf("#\n# Collective test concluded: %s\n#\n\n", program);
  fflush(stdout);
  return bw_failed;
}
