#include "pattern.h"

#include <string.h>
#include <strings.h>

/* uint32, uint64 and the fp8 types have no a2a dtype of their own; an
 * all-to-all only moves bytes, so a dtype of the same width moves them
 * exactly. */
const nte_dtype nte_dtypes[] = {
    {"int8", A2A_INT8, 1},      {"uint8", A2A_UINT8, 1},   {"int32", A2A_INT32, 4},
    {"uint32", A2A_INT32, 4},   {"int64", A2A_INT64, 8},   {"uint64", A2A_INT64, 8},
    {"half", A2A_FLOAT16, 2},   {"float", A2A_FLOAT32, 4}, {"double", A2A_FLOAT64, 8},
    {"bfloat16", A2A_BFLOAT16, 2}, {"f8e4m3", A2A_UINT8, 1}, {"f8e5m2", A2A_UINT8, 1},
};
const int nte_num_dtypes = (int)(sizeof(nte_dtypes) / sizeof(nte_dtypes[0]));

static const struct {
  const char* alias;
  const char* name;
} aliases[] = {
    {"char", "int8"},     {"int", "int32"},      {"float16", "half"},    {"fp16", "half"},
    {"float32", "float"}, {"fp32", "float"},     {"float64", "double"},  {"fp64", "double"},
    {"bf16", "bfloat16"}, {"fp8_e4m3", "f8e4m3"}, {"fp8_e5m2", "f8e5m2"},
};

const nte_dtype* nte_find_dtype(const char* name) {
  for (size_t i = 0; i < sizeof(aliases) / sizeof(aliases[0]); ++i)
    if (strcasecmp(name, aliases[i].alias) == 0) name = aliases[i].name;
  for (int i = 0; i < nte_num_dtypes; ++i)
    if (strcasecmp(name, nte_dtypes[i].name) == 0) return &nte_dtypes[i];
  return NULL;
}

/* Primes just below 2^8, 2^16 and 2^31: v < P fits the width and P itself
 * is the poison. */
static uint64_t prime_for(size_t size) { return size == 1 ? 251u : size == 2 ? 65521u : 2147483647u; }

/* An odd multiplier is a bijection of 64-bit integers: it spreads v over
 * all eight bytes and keeps P's image apart from every v's. */
static const uint64_t kSpread = 0x9E3779B97F4A7C15ull;

/* The slope 2*src+1 differs between sources, so a block from the wrong rank
 * or at the wrong offset does not match; rep changes the data of every
 * check round. */
static uint64_t value(int src, int dst, uint64_t index, int rep, uint64_t prime) {
  const uint64_t slope = (uint64_t)(2 * src + 1) % prime;
  const uint64_t offset = (7u * (uint64_t)src + 3u * (uint64_t)dst + 13u * (uint64_t)rep) % prime;
  return ((index % prime) * slope + offset) % prime;
}

static void store(unsigned char* at, size_t size, uint64_t v) {
  switch (size) {
    case 1: *at = (unsigned char)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(at, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(at, &x, 4); break; }
    default: { uint64_t x = v * kSpread; memcpy(at, &x, 8); break; }
  }
}

static int matches(const unsigned char* at, size_t size, uint64_t v) {
  unsigned char want[8];
  store(want, size, v);
  return memcmp(at, want, size) == 0;
}

void nte_fill(void* dst_buf, size_t size, size_t n, int src, int dst, uint64_t first, int rep) {
  const uint64_t prime = prime_for(size);
  unsigned char* at = (unsigned char*)dst_buf;
  for (size_t k = 0; k < n; ++k) store(at + k * size, size, value(src, dst, first + k, rep, prime));
}

int64_t nte_count_wrong(const void* got, size_t size, size_t n, int src, int dst, uint64_t first,
                        int rep) {
  const uint64_t prime = prime_for(size);
  const unsigned char* at = (const unsigned char*)got;
  int64_t wrong = 0;
  for (size_t k = 0; k < n; ++k) wrong += !matches(at + k * size, size, value(src, dst, first + k, rep, prime));
  return wrong;
}

void nte_fill_sent(void* buf, size_t size, const int64_t* counts, int num_ranks, int rank, int rep) {
  unsigned char* at = (unsigned char*)buf;
  for (int dst = 0; dst < num_ranks; ++dst) {
    nte_fill(at, size, (size_t)counts[dst], rank, dst, 0, rep);
    at += (size_t)counts[dst] * size;
  }
}

int64_t nte_count_wrong_received(const void* buf, size_t size, const int64_t* counts, int num_ranks, int rank,
                                 int rep) {
  const unsigned char* at = (const unsigned char*)buf;
  int64_t wrong = 0;
  for (int src = 0; src < num_ranks; ++src) {
    wrong += nte_count_wrong(at, size, (size_t)counts[src], src, rank, 0, rep);
    at += (size_t)counts[src] * size;
  }
  return wrong;
}

void nte_fill_sent_blocks(void* buf, size_t size, size_t block, int num_ranks, int rank, int rep) {
  for (int dst = 0; dst < num_ranks; ++dst)
    nte_fill((unsigned char*)buf + (size_t)dst * block * size, size, block, rank, dst, 0, rep);
}

int64_t nte_count_wrong_received_blocks(const void* buf, size_t size, size_t block, int num_ranks, int rank,
                                        int rep) {
  int64_t wrong = 0;
  for (int src = 0; src < num_ranks; ++src)
    wrong += nte_count_wrong((const unsigned char*)buf + (size_t)src * block * size, size, block, src, rank, 0, rep);
  return wrong;
}

void nte_poison(void* buf, size_t size, size_t n) {
  const uint64_t prime = prime_for(size);
  unsigned char* at = (unsigned char*)buf;
  for (size_t k = 0; k < n; ++k) store(at + k * size, size, prime);
}
