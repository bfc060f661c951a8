/* Datatypes as nccl-tests names them, and the deterministic data that every
 * rank writes and checks.
 *
 * An all-to-all moves bytes and never computes, so the check compares bit
 * patterns: element i of the block that rank `src` sends to rank `dst` in
 * check round `rep` is an integer v(src, dst, i, rep) below a prime P of the
 * element's width, stored as that width's raw pattern (8-byte elements
 * spread it over all 64 bits). The pattern P itself is never produced: it is
 * the poison written into receive buffers before a checked call. */
#ifndef NTE_PATTERN_H_
#define NTE_PATTERN_H_

#include <a2a/a2a.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
  const char* name;   /* nccl-tests' name, printed in the `type` column */
  a2a_dtype_t a2a;    /* the a2a dtype of the same width that moves it */
  size_t size;        /* bytes per element */
} nte_dtype;

/* nccl-tests' datatype list, in its order. */
extern const nte_dtype nte_dtypes[];
extern const int nte_num_dtypes;

/* The dtype named `name` (nccl-tests' names and aliases), or NULL. */
const nte_dtype* nte_find_dtype(const char* name);

/* Writes v(src, dst, first + k, rep) for k < n into dst_buf, element by
 * element (width `size`). */
void nte_fill(void* dst_buf, size_t size, size_t n, int src, int dst, uint64_t first, int rep);

/* Elements of `got` (n of width `size`) that differ from
 * v(src, dst, first + k, rep). */
int64_t nte_count_wrong(const void* got, size_t size, size_t n, int src, int dst, uint64_t first,
                        int rep);

/* The packed layout of MPI_Alltoallv: block j of `buf` holds counts[j]
 * elements, blocks in rank order. fill_sent writes what `rank` sends to
 * each rank j; count_wrong_received counts the elements that differ from
 * what each rank j sends to `rank`. */
void nte_fill_sent(void* buf, size_t size, const int64_t* counts, int num_ranks, int rank, int rep);
int64_t nte_count_wrong_received(const void* buf, size_t size, const int64_t* counts, int num_ranks, int rank,
                                 int rep);

/* The same with `block` elements for every rank (MPI_Alltoall's layout). */
void nte_fill_sent_blocks(void* buf, size_t size, size_t block, int num_ranks, int rank, int rep);
int64_t nte_count_wrong_received_blocks(const void* buf, size_t size, size_t block, int num_ranks, int rank,
                                        int rep);

/* Fills n elements of width `size` with the poison pattern. */
void nte_poison(void* buf, size_t size, size_t n);

#endif /* NTE_PATTERN_H_ */
