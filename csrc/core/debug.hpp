// The debug channel: A2A_DEBUG=WARN or INFO prints lines on stderr, each
// prefixed with the process's rank:
//
//   [a2a rank 3] INFO communicator created: rank 3 of 8, 2 nodes x 4 ranks ...
//   [a2a rank 3] WARN rank 3 of 8: timed out after 300 s (A2A_TIMEOUT_S) in ...
//
// Silent by default. WARN: timeouts (every one, where its error is made: see
// fail() in core/error.hpp). INFO: also what communicator creation decided
// (topology and where it came from, transports, device) and whatever else
// calls info(). The level is read from A2A_DEBUG when a communicator is
// created (an unknown value fails the creation, see level_from_env) and, for
// messages before any creation, at the first check.
#pragma once

#include <atomic>
#include <string>
#include <utility>

#include "core/error.hpp"

namespace a2a::debug {

enum class Level : int { kOff = 0, kWarn = 1, kInfo = 2 };

// The level A2A_DEBUG asks for: unset or empty is kOff, "WARN" or "INFO" (any
// case) the matching level. Anything else throws A2A_ERROR_INVALID_ARGUMENT
// naming the accepted values.
Level level_from_env();
// Makes `level` the process's level from now on (communicator creation).
void set_level(Level level);
// The rank printed in the prefix: communicator creation sets the process's
// rank in MPI_COMM_WORLD (or in a NCCL communicator made from an id).
void set_rank(int rank);

namespace detail {
// -1 until A2A_DEBUG has been read.
extern std::atomic<int> level;
int read_level_once();
void emit(Level level, const std::string& message);
}  // namespace detail

// Whether lines of `level` are printed: one relaxed atomic load.
inline bool enabled(Level level) {
  int current = detail::level.load(std::memory_order_relaxed);
  if (current < 0) current = detail::read_level_once();
  return static_cast<int>(level) <= current;
}

// Prints one line; the arguments are formatted (as by cat) only when the
// level is on.
template <typename... Args>
void info(Args&&... args) {
  if (enabled(Level::kInfo)) detail::emit(Level::kInfo, cat(std::forward<Args>(args)...));
}
template <typename... Args>
void warn(Args&&... args) {
  if (enabled(Level::kWarn)) detail::emit(Level::kWarn, cat(std::forward<Args>(args)...));
}

}  // namespace a2a::debug
