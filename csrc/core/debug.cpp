#include "core/debug.hpp"

#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace a2a {

namespace debug {

namespace detail {
std::atomic<int> level{-1};
}  // namespace detail

namespace {

std::atomic<int> rank_label{-1};

}  // namespace

Level level_from_env() {
  const char* text = std::getenv("A2A_DEBUG");
  std::string value = text == nullptr ? "" : text;
  for (char& c : value) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (value.empty()) return Level::kOff;
  if (value == "WARN") return Level::kWarn;
  if (value == "INFO") return Level::kInfo;
  fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_DEBUG='", text, "' is not a debug level; accepted: WARN, INFO (or unset)");
}

void set_level(Level level) { detail::level.store(static_cast<int>(level), std::memory_order_relaxed); }

void set_rank(int rank) { rank_label.store(rank, std::memory_order_relaxed); }

int detail::read_level_once() {
  // Before any communicator exists: an unknown value stays silent here and
  // fails the first creation.
  Level read = Level::kOff;
  try {
    read = level_from_env();
  } catch (const Failure&) {
  }
  int expected = -1;
  level.compare_exchange_strong(expected, static_cast<int>(read), std::memory_order_relaxed);
  return level.load(std::memory_order_relaxed);
}

void detail::emit(Level level, const std::string& message) {
  const int rank = rank_label.load(std::memory_order_relaxed);
  const std::string line = cat(rank >= 0 ? cat("[a2a rank ", rank, "] ") : std::string("[a2a] "),
                               level == Level::kWarn ? "WARN " : "INFO ", message, "\n");
  // One write per line, so that lines of several threads do not interleave.
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace debug

void warn_timeout(const std::string& message) { debug::warn(message); }

}  // namespace a2a
