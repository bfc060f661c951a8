// Argument checks shared by the MoE entry points (moe/moe.cpp: routing,
// dispatch, combine; moe/es_ops.cpp: the expert-specific operators), and the
// choice of backend for an a2a_exec_t.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "a2a/a2a.h"
#include "core/error.hpp"
#include "moe/kernels.hpp"

namespace a2a::moe {

// The backend of exec (CPU threads, or CUDA on its stream).
std::unique_ptr<Kernels> make_kernels(const a2a_exec_t* exec);

bool is_float(a2a_dtype_t dtype);
bool is_index(a2a_dtype_t dtype);
// a * b, failing with A2A_ERROR_INVALID_ARGUMENT when it overflows int64.
int64_t checked_product(const char* op, int64_t a, int64_t b, const char* what);
// T >= 0, k >= 1, E >= 1, and T * k * E within the backends' counters.
void check_shape(const char* op, int64_t num_tokens, int64_t top_k, int64_t num_experts);

template <typename... Args>
void require(bool ok, Args&&... args) {
  if (!ok) fail(A2A_ERROR_INVALID_ARGUMENT, std::forward<Args>(args)...);
}

// The memory arguments of one call, as Checker::buffers checks the
// collectives': each one NULL only when empty, and no output (or scratch)
// sharing a byte with any other argument. The kernels read and write in
// parallel, so an output over an input (out=x, or one row apart) would give
// wrong results without an error.
class Buffers {
 public:
  explicit Buffers(const char* op) : op_(op) {}
  Buffers& input(const char* name, const void* data, size_t bytes) { return add(name, data, bytes, false); }
  Buffers& output(const char* name, const void* data, size_t bytes) { return add(name, data, bytes, true); }
  // The routing's arrays, all inputs.
  Buffers& routing(const a2a_routing_t& r) {
    const size_t choices = static_cast<size_t>(r.num_tokens * r.top_k);
    const size_t experts = static_cast<size_t>(r.num_experts);
    return input("routing.indices", r.indices, choices * dtype_size(r.index_dtype))
        .input("routing.locations", r.locations, choices * sizeof(int64_t))
        .input("routing.counts", r.counts, experts * sizeof(int64_t))
        .input("routing.expert_offsets", r.expert_offsets, (experts + 1) * sizeof(int64_t));
  }

 private:
  struct Region {
    const char* name;
    const char* begin;
    size_t bytes;
    bool written;
  };
  Buffers& add(const char* name, const void* data, size_t bytes, bool written) {
    require(bytes == 0 || data != nullptr, op_, ": ", name, " is NULL");
    const Region mine{name, static_cast<const char*>(data), bytes, written};
    for (const Region& other : regions_) {
      const bool overlap = mine.bytes != 0 && other.bytes != 0 && mine.begin < other.begin + other.bytes &&
                           other.begin < mine.begin + mine.bytes;
      if (overlap && (written || other.written))
        fail(A2A_ERROR_INVALID_ARGUMENT, op_, ": ", written ? "output " : "input ", name, " overlaps ",
             other.written ? "output " : "input ", other.name, " (", mine.bytes, " and ", other.bytes, " bytes at ",
             static_cast<const void*>(mine.begin), " and ", static_cast<const void*>(other.begin),
             "); the kernels do not work in place: give every output memory of its own");
    }
    regions_.push_back(mine);
    return *this;
  }

  const char* op_;
  std::vector<Region> regions_;
};

// Bytes of a x b elements of `element` bytes each; an overflow fails, naming op.
size_t checked_bytes(const char* op, int64_t a, int64_t b, size_t element);

// Bytes of `rows` rows of model_dim elements of dtype (checked_bytes).
size_t data_bytes(const char* op, int64_t rows, int64_t model_dim, a2a_dtype_t dtype);

}  // namespace a2a::moe
