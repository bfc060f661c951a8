// Process-wide worker threads for the CPU kernels. The calling thread takes
// part, so a job on n threads has n - 1 workers. Callers on different threads
// run at once, each on a pool of its own; a parallel_for inside a slice (a
// nested one) runs inline on the thread that runs the slice.
#pragma once

#include <cstdint>
#include <functional>

namespace a2a::cpu {

// Threads to use when the caller asks for 0: A2A_NUM_THREADS, else every core.
int default_num_threads();
// Threads for one of `ranks_on_host` processes sharing this host's cores:
// A2A_NUM_THREADS when set, else max(1, cores / ranks_on_host).
int threads_per_rank(int ranks_on_host);

// Runs body(begin, end) over contiguous slices of [0, n) on up to
// `num_threads` threads, each slice at least `grain` long (so small jobs stay
// on the calling thread). Slice s of `slices` covers
// [n * s / slices, n * (s + 1) / slices). Returns when every slice is done;
// the first exception thrown by a slice is rethrown here. Called from inside
// a slice, it runs body(0, n) on the calling thread.
void parallel_for(int64_t n, int64_t grain, int num_threads, const std::function<void(int64_t, int64_t)>& body);

// The grain of a parallel_for over items of `elements_per_item` elements
// each: enough elements per slice (2^15) that waking a thread pays off.
int64_t grain_for(int64_t elements_per_item);

// How many slices parallel_for(n, grain, num_threads, ...) cuts [0, n) into.
int slice_count(int64_t n, int64_t grain, int num_threads);

}  // namespace a2a::cpu
