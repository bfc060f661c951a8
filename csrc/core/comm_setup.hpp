// What every way of creating a communicator shares: reading the settings
// (with errors held back until every rank has heard of them) and agreeing on
// the topology and the requested device and transport across ranks.
#pragma once

#include <string>

#include "a2a/a2a.h"
#include "core/error.hpp"
#include "core/topology.hpp"
#include "core/transport.hpp"

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
constexpr double kDefaultTimeoutS = 300.0;

// How a rank sees its node before the agreement.
struct LocalSizeProposal {
  int local_size = 1;
  bool explicit_size = false;     // given by the caller or the environment, not detected
  std::string source;             // where it came from, for errors
  std::string irregular_reason;   // detection found unequal or non-contiguous nodes
};

// Collective over `control`: shares setting errors (this rank's are in
// `settings`), checks that device_type and transport agree, that a given
// local_size is given and equal everywhere, and builds the topology (an
// irregular one still works for the linear algorithms).
Topology agree_topology(Transport& control, const LocalSizeProposal& proposal, const a2a_comm_config_t& config,
                        const SettingReader& settings);

}  // namespace a2a
