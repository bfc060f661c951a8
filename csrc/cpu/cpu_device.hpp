// Host memory; layout copies are memcpy over chunks.
#pragma once

#include "core/device.hpp"

namespace a2a {

class CpuDevice final : public Device {
 public:
  const char* name() const override { return "cpu"; }
  void copy(void* dst, const void* src, size_t bytes) override;
  void transpose_chunks(void* dst, const void* src, size_t rows, size_t cols, size_t chunk_bytes) override;
  void copy_ranges(void* dst, const void* src, const CopyRange* ranges, size_t count) override;
};

}  // namespace a2a
