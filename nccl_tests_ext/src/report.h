/* The output, in nccl-tests' format (its src/util.cu): the same lines, the
 * same field widths, the same number formatting. Rank 0 calls these. */
#ifndef NTE_REPORT_H_
#define NTE_REPORT_H_

#include <stddef.h>
#include <stdint.h>

#include "options.h"

/* "# nThread ..." and the blocking lines, up to "# Using devices". */
void nte_report_start(const char* program, const nte_options* opts);
/* "#  Rank %2d Group %2d Pid %6d on %10s <device fields>" */
void nte_report_rank(int rank, int pid, const char* host, const char* device_fields);
/* The two-level column header (preceded by "#"). */
void nte_report_columns(const nte_options* opts);
/* One row: the five leading fields and the out-of-place group; the
 * in-place group stays empty (a2a's collectives are out of place). */
void nte_report_row(size_t bytes, size_t count, const char* type, double time_us, double algbw, double busbw,
                    int report_errors, int64_t wrong);
/* "# Out of bounds values", "# Avg bus bandwidth" (OK/FAILED against
 * NCCL_TESTS_MIN_BW when set) and the closing lines. Returns 1 when the
 * bandwidth check failed. */
int nte_report_end(const char* program, int errors, double avg_busbw);

#endif /* NTE_REPORT_H_ */
