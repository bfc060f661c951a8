// The predicted check's predictor (csrc/core/call_predictor.hpp), built by
// tests/unit/test_call_predictor.py: which call it predicts after which
// history. Prints "ok: <case>" per case, "FAIL: ..." otherwise.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/call_predictor.hpp"

using a2a::CallPredictor;

namespace {

int failures = 0;

// Pushes `history`, then checks the prediction: `expected` 0 for none.
void check(const char* name, const std::vector<uint64_t>& history, uint64_t expected) {
  CallPredictor predictor;
  for (uint64_t key : history) predictor.push(key);
  uint64_t key = 0;
  const bool predicted = predictor.predict(&key);
  const bool ok = expected == 0 ? !predicted : predicted && key == expected;
  if (ok) {
    std::printf("ok: %s\n", name);
  } else {
    std::printf("FAIL: %s: predicted %d, key %llu, expected %llu\n", name, predicted ? 1 : 0,
                static_cast<unsigned long long>(key), static_cast<unsigned long long>(expected));
    ++failures;
  }
}

// A step of `step` repeated `times` times.
std::vector<uint64_t> repeat(const std::vector<uint64_t>& step, int times) {
  std::vector<uint64_t> out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), step.begin(), step.end());
  return out;
}

}  // namespace

int main() {
  check("nothing yet", {}, 0);
  check("one call", {7}, 0);
  check("the same call twice", {7, 7}, 7);
  check("a change", {7, 7, 8}, 0);
  check("a step of two, twice", repeat({1, 2}, 2), 1);
  check("a step of A A B B, at its end", repeat({1, 1, 2, 2}, 3), 1);
  check("a step of A A B B, after A A", [] {
    auto h = repeat({1, 1, 2, 2}, 3);
    h.push_back(1);
    h.push_back(1);
    return h;
  }(), 2);
  check("a step of 32 calls", repeat([] {
    std::vector<uint64_t> step;
    for (uint64_t k = 1; k <= 32; ++k) step.push_back(k);
    return step;
  }(), 2), 1);
  check("a step of 33 calls is too long", repeat([] {
    std::vector<uint64_t> step;
    for (uint64_t k = 1; k <= 33; ++k) step.push_back(k);
    return step;
  }(), 3), 0);
  return failures == 0 ? 0 : 1;
}
