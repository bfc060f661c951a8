// Reading a communicator's settings (config fields and environment
// variables) without throwing: a rank with a bad setting still makes the
// collective calls of creation, and the error is shared in agree_topology()
// (setup/agree_topology.hpp), so that every rank fails together.
#pragma once

#include <string>

#include "a2a/a2a.h"
#include "core/error.hpp"

namespace a2a {

// Reads settings without throwing: the first error is kept in error() so
// that the rank still makes the collective calls the others make, and the
// error is shared in agree_topology().
class SettingReader {
 public:
  template <typename Read, typename Fallback>
  Fallback read(Read&& reader, Fallback fallback) {
    try {
      return reader();
    } catch (const Failure& e) {
      keep(e.status(), e.what());
      return fallback;
    } catch (const std::exception& e) {
      keep(A2A_ERROR_INVALID_ARGUMENT, e.what());
      return fallback;
    }
  }
  const std::string& error() const { return error_; }
  // The status of the first error: A2A_ERROR_UNSUPPORTED stays that (e.g. no
  // CUDA device), anything else reads as a bad setting.
  a2a_status_t status() const { return status_; }

 private:
  void keep(a2a_status_t status, const char* what) {
    if (!error_.empty()) return;
    error_ = what;
    status_ = status == A2A_ERROR_UNSUPPORTED ? status : A2A_ERROR_INVALID_ARGUMENT;
  }
  std::string error_;
  a2a_status_t status_ = A2A_SUCCESS;
};

// A non-negative integer environment variable; -1 when unset.
long env_int(const char* name);
// config.timeout_s, else A2A_TIMEOUT_S, else 300.
double timeout_from(const a2a_comm_config_t& config);
// config.cross_check (1 or 0), else A2A_CROSS_CHECK, else on.
bool cross_check_from(const a2a_comm_config_t& config);
constexpr double kDefaultTimeoutS = 300.0;

}  // namespace a2a
