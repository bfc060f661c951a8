// Errors inside the core are a2a::Failure exceptions carrying an a2a_status_t
// (named apart from the public a2a::Error of a2a.hpp); the C ABI
// (c_api.cpp) turns them into status codes plus a2a_get_last_error() text.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "a2a/a2a.h"

namespace a2a {

class Failure : public std::runtime_error {
 public:
  Failure(a2a_status_t status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  a2a_status_t status() const { return status_; }

 private:
  a2a_status_t status_;
};

// Concatenates anything streamable: cat("rank ", r, ": ", n, " bytes").
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

// Prints `message` as a WARN line of the debug channel (core/debug.hpp).
void warn_timeout(const std::string& message);

// Throws Failure(status, the arguments concatenated). A timeout is also
// printed on the debug channel (A2A_DEBUG=WARN or INFO) as it is made, so
// every transport's timeout shows up there, named as in the error.
template <typename... Args>
[[noreturn]] void fail(a2a_status_t status, Args&&... args) {
  std::string message = cat(std::forward<Args>(args)...);
  if (status == A2A_ERROR_TIMEOUT) warn_timeout(message);
  throw Failure(status, message);
}

}  // namespace a2a
