// Bounded waiting by polling, for waits that have no timeout of their own
// (a CUDA stream, a non-blocking NCCL communicator).
#pragma once

#include <chrono>
#include <thread>

namespace a2a {

// Calls done() until it returns true (then returns true), or until timeout_s
// seconds have passed (then returns false). done() may throw. The first polls
// only yield, since most waits are short; later ones sleep briefly so that a
// long wait does not hold a core.
template <typename Done>
bool poll_until(double timeout_s, Done&& done) {
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0;; ++round) {
    if (done()) return true;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) return false;
    if (round < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace a2a
