// A process-wide pool of worker threads for the CPU kernels. The calling
// thread takes part, so a pool of n threads has n - 1 workers. Calls from
// different threads are serialized.
#pragma once

#include <cstdint>
#include <functional>

namespace a2a::cpu {

// Threads to use when the caller asks for 0: A2A_NUM_THREADS, else every core.
int default_num_threads();

// Runs body(begin, end) over contiguous slices of [0, n) on up to
// `num_threads` threads, each slice at least `grain` long (so small jobs stay
// on the calling thread). Slice s of `slices` covers
// [n * s / slices, n * (s + 1) / slices). Returns when every slice is done;
// the first exception thrown by a slice is rethrown here.
void parallel_for(int64_t n, int64_t grain, int num_threads, const std::function<void(int64_t, int64_t)>& body);

// How many slices parallel_for(n, grain, num_threads, ...) cuts [0, n) into.
int slice_count(int64_t n, int64_t grain, int num_threads);

}  // namespace a2a::cpu
