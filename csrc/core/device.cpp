#include "core/device.hpp"

#include <cstdlib>
#include <new>

namespace a2a {

void* Device::allocate_host_impl(size_t bytes) {
  void* pointer = std::malloc(bytes == 0 ? 1 : bytes);
  if (pointer == nullptr) throw std::bad_alloc();
  return pointer;
}

void Device::free_host_impl(void* pointer) { std::free(pointer); }

DeviceBuffer::~DeviceBuffer() {
  try {
    if (data_ != nullptr) device_.synchronize(1.0);  // best effort: copies may still read it
  } catch (...) {
  }
  release();
}

void DeviceBuffer::release() {
  if (data_ == nullptr) return;
  if (kind_ == Kind::kHost)
    device_.free_host(data_);
  else
    device_.free_device(data_);
  data_ = nullptr;
  capacity_ = 0;
}

char* DeviceBuffer::reserve(size_t bytes, double timeout_s) {
  if (data_ != nullptr && capacity_ >= bytes) return data_;
  if (data_ != nullptr) device_.synchronize(timeout_s);
  release();
  const size_t capacity = bytes < 4096 ? 4096 : bytes + bytes / 4;  // room to grow without reallocating each time
  data_ = static_cast<char*>(kind_ == Kind::kHost ? device_.allocate_host(capacity) : device_.allocate_device(capacity));
  capacity_ = capacity;
  return data_;
}

}  // namespace a2a
