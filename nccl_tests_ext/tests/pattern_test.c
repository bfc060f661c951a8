/* The data check of the benchmarks finds what it must: run by
 * tests/c/run_nccl_tests_ext.py. Prints one line per failed expectation and
 * exits non-zero if there is any. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pattern.h"

static int failures = 0;

static void expect(int64_t got, int64_t want, const char* what, size_t size) {
  if (got == want) return;
  printf("FAIL: %s (%zu-byte elements): got %lld, expected %lld\n", what, size, (long long)got, (long long)want);
  failures += 1;
}

int main(void) {
  enum { kRanks = 4, kCount = 100, kMe = 2 };
  const size_t widths[] = {1, 2, 4, 8};
  int64_t counts[kRanks] = {kCount, kCount, kCount, kCount};
  for (size_t w = 0; w < sizeof widths / sizeof widths[0]; ++w) {
    const size_t size = widths[w], bytes = kRanks * kCount * size, block = kCount * size;
    unsigned char* got = malloc(bytes);
    unsigned char* block_copy = malloc(block);
    /* What each rank sends rank kMe, as an exchange delivers it. */
    for (int src = 0; src < kRanks; ++src) nte_fill(got + (size_t)src * block, size, kCount, src, kMe, 0, 7);
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe, 7), 0, "a correct exchange", size);
    expect(nte_count_wrong_received_blocks(got, size, kCount, kRanks, kMe, 7), 0, "equal blocks", size);
    expect(nte_count_wrong_received_blocks(got, size, kCount - 1, kRanks, kMe, 7), (kRanks - 1) * (kCount - 1),
           "blocks one element short (all but the first shifted)", size);
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe, 8), kRanks * kCount,
           "data of another check round", size);
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe + 1, 7), kRanks * kCount,
           "data meant for another rank", size);
    got[5 * size + size - 1] ^= 1; /* one bit of one element */
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe, 7), 1, "one flipped bit", size);
    got[5 * size + size - 1] ^= 1;
    memcpy(block_copy, got, block); /* blocks of ranks 0 and 1 swapped */
    memcpy(got, got + block, block);
    memcpy(got + block, block_copy, block);
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe, 7), 2 * kCount, "two blocks swapped", size);
    nte_poison(got, size, kRanks * kCount); /* a call that wrote nothing */
    expect(nte_count_wrong_received(got, size, counts, kRanks, kMe, 7), kRanks * kCount, "the poison", size);
    /* nte_fill_sent lays out what kMe sends; rank 0 then finds its block at 0. */
    nte_fill_sent_blocks(got, size, kCount, kRanks, kMe, 7);
    expect(nte_count_wrong(got + 3 * block, size, kCount, kMe, 3, 0, 7), 0, "equal sent blocks", size);
    nte_fill_sent(got, size, counts, kRanks, kMe, 7);
    expect(nte_count_wrong(got, size, kCount, kMe, 0, 0, 7), 0, "the sent layout", size);
    expect(nte_count_wrong(got + block, size, kCount, kMe, 0, 0, 7), kCount, "the block of another destination",
           size);
    free(got);
    free(block_copy);
  }
  const char* names[] = {"int8", "char", "uint32", "fp16", "bf16", "f8e5m2", "double"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
    if (!nte_find_dtype(names[i])) {
      printf("FAIL: datatype %s is not known\n", names[i]);
      failures += 1;
    }
  if (nte_find_dtype("uint128")) {
    printf("FAIL: datatype uint128 is known\n");
    failures += 1;
  }
  printf("%s: data pattern checks\n", failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
