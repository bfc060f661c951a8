// Which call comes next on a communicator, predicted alike on every rank from
// the calls every rank agreed on (docs/algorithms.md, "The predicted check").
// A training loop repeats the same calls step after step: once the last 2p
// calls are one block of p calls twice over (p <= kMaxPeriod), the next call
// is predicted to be the one p calls back (of several such p, the one that
// has held longest). A wrong prediction costs a round, never an error: every
// rank predicts alike, so every rank finds its call unpredicted alike. Each
// call is known by its key, a digest of its op and arguments (not of its
// place in the sequence).
#pragma once

#include <array>
#include <cstdint>

namespace a2a {

class CallPredictor {
 public:
  static constexpr int kMaxPeriod = 32;

  // The call every rank agreed on (by a round, or by predicting it).
  void push(uint64_t key) {
    ++count_;
    keys_[index(0)] = key;
    for (int p = 1; p <= kMaxPeriod; ++p)
      repeats_[p] = count_ > p && keys_[index(p)] == key ? repeats_[p] + 1 : 0;
  }

  // The key predicted for the next call; false while no period shows. Of
  // the periods that show, the one that has held longest: in a step of
  // calls A A B B, the period 1 of "A A" shows every other call, and 4
  // holds throughout.
  bool predict(uint64_t* key) const {
    int best = 0;
    for (int p = 1; p <= kMaxPeriod; ++p)
      if (repeats_[p] >= p && (best == 0 || repeats_[p] > repeats_[best])) best = p;
    if (best == 0) return false;
    *key = keys_[index(best - 1)];
    return true;
  }

 private:
  // The slot of the call `back` calls before the last pushed one.
  int64_t index(int back) const {
    return ((count_ - 1 - back) % kSlots + kSlots) % kSlots;
  }
  static constexpr int kSlots = 2 * kMaxPeriod + 1;
  std::array<uint64_t, kSlots> keys_{};
  // repeats_[p]: how many of the last calls each equal the call p before it.
  std::array<int64_t, kMaxPeriod + 1> repeats_{};
  int64_t count_ = 0;
};

}  // namespace a2a
