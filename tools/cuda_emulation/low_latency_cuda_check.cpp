// low_latency_cuda.cu's host functions and kernels (pack_index_kernel,
// pack_rows_kernel, reject_kernel, unpack_index_kernel, unpack_rows_kernel,
// return_kernel, combine_kernel), through cuda_low_latency_*, run by the
// CUDA emulation of include/ (see run.py) against their CPU twins
// (cpu/low_latency_cpu.cpp: low_latency_*_cpu) and a model of the exchange,
// over whole low-latency calls of 1 to 5 ranks. Each case builds every
// rank's workspace (moe/low_latency.cpp's layout_of, replicated here), one
// per backend and rank (over different stale bytes, so that a read of a
// byte neither side wrote shows, or all zeros as before a first use; the
// status record clear), and then:
//   - pack on every rank (max_tokens 1 to 24, num_tokens 0..max_tokens,
//     top_k 1 to 4, 1 to 3 local experts, row_bytes odd or a multiple of 16,
//     x 16-byte aligned or not, int32 or int64 indices with unrouted choices
//     (-1, -2, INT32_MIN, INT64_MIN) and experts repeated within a token):
//     the send slots' headers, rows, zero padding and (token, local expert)
//     meta and the choices table bytewise against the CPU, the CPU against
//     the model, and every other byte of the workspace as it was;
//   - the exchange: each rank's send slot p, whole, into rank p's receive
//     slot of that rank (as NCCL moves them on CUDA);
//   - unpack: recv_counts, the counted rows of recv and the arrivals of the
//     counted rows bytewise against the CPU (and the model: local expert e's
//     rows source by source, each source's in token order), nothing else of
//     recv or the workspace written;
//   - return (model_dim 1 to 129 of float32, float64, float16, bfloat16):
//     the send slots' headers and rows of the way back bytewise against the
//     CPU and the model, then the exchange back;
//   - combine: y bitwise against the CPU and the model (every product
//     rounded alone, summed in choice order from 0), with no gates, float32
//     gates or gates of the data's dtype;
//   - the status record, read from the workspace, clear; then
//     cuda_low_latency_status (the emulated stream is always idle) must
//     return it and clear it.
// Faults, one per case: indices >= num_experts on some ranks (CUDA only, as
// the CPU orchestration refuses them before packing: the choice is skipped,
// so the call is the CPU's with those choices made -1, and bad_choice /
// bad_value name the first); one or two ranks that reject their dispatch or
// their combine (reject_kernel); a receive slot's header of another
// sequence, kind, source or count, or a received row's meta beyond the
// handle's. Where the CPU throws, A2A_ERROR_REMOTE must meet rejected_by
// (the lowest rejecting rank) and A2A_ERROR_MISMATCH mismatched_from (the
// peer), and nothing else may be noted. Each operation runs under two
// schedules (check.hpp), with grids capped at 1 to 3 blocks
// (EsLaunch::max_blocks) so that the grid-stride loops turn; every output
// (workspace, recv, recv_counts, y) has guard bytes on both sides, and the
// inputs must stay as they were.
// `low_latency_cuda_check CASES [SEED]`; exits 1 on any failure.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "check.hpp"
#include "cpu/low_latency_cpu.hpp"
#include "cuda/low_latency_cuda.hpp"
#include "moe/fp8.hpp"
#include "moe/kernels.hpp"

using namespace check;
using namespace a2a;
using namespace a2a::moe;

namespace {

// Tallies of what the cases covered, printed at the end.
long long by_world[6], zero_token_ranks, repeated_choices, unrouted_choices, vector_rows, byte_rows, grid_strided;
long long rows_sent, rows_combined, slots_over_a_warp, wrapped_sequences, fresh_workspaces, fault_cases[7];
long long cpu_errors_met;

constexpr int64_t kHeader = sizeof(LowLatencyHeader);

// A config (the fields a2a_low_latency_config_t has) and its layout, as
// moe/low_latency.cpp makes it (moe/kernels.hpp's low_latency_layout).
struct Config {
  int64_t max_tokens, num_experts, top_k, row_bytes, model_dim;
  a2a_dtype_t dtype;
};
LowLatencyLayout layout_of(const Config& c, int world, int rank) {
  a2a_low_latency_config_t config = A2A_LOW_LATENCY_CONFIG_INIT;
  config.max_tokens = c.max_tokens;
  config.num_experts = c.num_experts;
  config.top_k = c.top_k;
  config.row_bytes = c.row_bytes;
  config.model_dim = c.model_dim;
  config.dtype = c.dtype;
  return low_latency_layout(config, world, rank);
}

enum Fault { kNone, kBadIndex, kRejectDispatch, kDispatchHeader, kBadMeta, kRejectCombine, kCombineHeader };
const char* fault_name(int f) {
  static const char* names[] = {"none", "bad-index", "reject-dispatch", "dispatch-header", "bad-meta",
                                "reject-combine", "combine-header"};
  return names[f];
}

std::unique_ptr<Guarded> guarded(size_t bytes, size_t misalignment) {
  return std::make_unique<Guarded>(bytes, misalignment);
}
void random_bytes(Guarded& g) {
  for (size_t i = 0; i < g.bytes(); ++i) g.data()[i] = static_cast<unsigned char>(rng());
}
std::vector<unsigned char> snapshot(const Guarded& g) { return {g.data(), g.data() + g.bytes()}; }
bool unchanged(const Guarded& g, const std::vector<unsigned char>& before) {
  return std::equal(before.begin(), before.end(), g.data());
}

// What a workspace byte is, for messages.
std::string where(const LowLatencyLayout& l, size_t at) {
  char text[160];
  auto slot = [&](const char* region, size_t base) {
    const int64_t in = static_cast<int64_t>(at - base), peer = in / l.slot_bytes, off = in % l.slot_bytes;
    if (off < kHeader)
      std::snprintf(text, sizeof text, "%s slot %ld header byte %ld", region, peer, off);
    else
      std::snprintf(text, sizeof text, "%s slot %ld byte %ld of the rows", region, peer, off - kHeader);
  };
  if (at < l.recv)
    slot("send", l.send);
  else if (at < l.choices)
    slot("receive", l.recv);
  else if (at < l.arrivals)
    std::snprintf(text, sizeof text, "choices[%zu]", (at - l.choices) / 8);
  else if (at < l.status)
    std::snprintf(text, sizeof text, "arrivals[%zu]", (at - l.arrivals) / 8);
  else
    std::snprintf(text, sizeof text, "the status record byte %zu", at - l.status);
  return text;
}

// The first byte where a differs from b, or -1.
int64_t first_difference(const unsigned char* a, const unsigned char* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

// One rank of a case: its inputs, the model of what it sends, and each
// backend's buffers.
struct Rank {
  LowLatencyLayout l;
  int64_t num_tokens = 0;
  a2a_dtype_t index_dtype = A2A_INT64;
  std::vector<int64_t> indices64, clean64;  // as given to CUDA; bad ones made -1, for the CPU
  std::vector<int32_t> indices32, clean32;
  int64_t first_bad = -1, first_bad_value = 0;
  std::unique_ptr<Guarded> x;
  std::vector<unsigned char> x_before;
  // The model: the code of every choice ((destination << 32) | row, or -1)
  // and the rows of each send slot as (token, local expert).
  std::vector<int64_t> codes;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> slots;
  // The model of what this rank receives: per local expert, (source, row of
  // its slot) in order; arrivals of each (source, row).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> experts;
  std::vector<int64_t> arrivals;
  // Buffers: the workspaces, recv and recv_counts of both backends.
  std::unique_ptr<Guarded> gpu_ws, cpu_ws, gpu_recv, cpu_recv, gpu_counts, cpu_counts, expert_out, y_gpu, y_cpu;
  std::vector<int64_t> sent, received;  // the CPU's
  bool rejects = false;                 // this call (dispatch or combine) is rejected here

  const void* gpu_indices() const {
    return index_dtype == A2A_INT32 ? static_cast<const void*>(indices32.data()) : indices64.data();
  }
  const void* cpu_indices() const {
    return index_dtype == A2A_INT32 ? static_cast<const void*>(clean32.data()) : clean64.data();
  }
  LowLatencyStatus status() const {
    LowLatencyStatus s;
    std::memcpy(&s, gpu_ws->data() + l.status, sizeof s);
    return s;
  }
  LowLatencyHeader header(const Guarded& ws, size_t region, int64_t peer) const {
    LowLatencyHeader h;
    std::memcpy(&h, ws.data() + region + peer * l.slot_bytes, sizeof h);
    return h;
  }
};

std::string status_text(const LowLatencyStatus& s) {
  char text[160];
  std::snprintf(text, sizeof text, "{rejected_by %ld, mismatched_from %ld, bad_choice %ld, bad_value %ld}",
                s.rejected_by, s.mismatched_from, s.bad_choice, s.bad_value);
  return text;
}
bool same_status(const LowLatencyStatus& a, const LowLatencyStatus& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Runs a CUDA operation under two schedules; its outputs keep their guards.
void gpu_op(const std::string& what, std::initializer_list<Guarded*> outputs, const std::function<void()>& op) {
  std::vector<Region> regions;
  for (Guarded* g : outputs) regions.push_back({g->data(), g->bytes()});
  const std::string error = two_schedules(what, regions, op);
  expect(error.empty(), "%s: %s", what.c_str(), error.c_str());
  for (Guarded* g : outputs) expect(g->guards_intact(), "%s: wrote outside an output", what.c_str());
}

// Runs a CPU operation; returns the status of the Failure it threw (A2A_SUCCESS: none).
a2a_status_t cpu_op(const std::string& what, std::string* message, const std::function<void()>& op) {
  try {
    op();
  } catch (const Failure& failure) {
    *message = failure.what();
    return failure.status();
  } catch (const std::exception& e) {
    fail("%s: the CPU threw something else than a Failure: %s", what.c_str(), e.what());
    return A2A_ERROR_INTERNAL;
  }
  return A2A_SUCCESS;
}

// The CUDA side's workspace against `expected` (the CPU's bytes where both
// wrote, the CUDA side's own bytes elsewhere).
bool same_workspace(const std::string& what, const Rank& r, const std::vector<unsigned char>& expected) {
  const int64_t at = first_difference(r.gpu_ws->data(), expected.data(), expected.size());
  return expect(at < 0, "%s: rank %d's workspace differs at byte %ld (%s): %#x, %#x expected", what.c_str(), r.l.rank,
                at, at < 0 ? "" : where(r.l, static_cast<size_t>(at)).c_str(),
                at < 0 ? 0 : r.gpu_ws->data()[at], at < 0 ? 0 : expected[static_cast<size_t>(at)]);
}
void overlay(std::vector<unsigned char>& expected, const Guarded& from, size_t at, size_t bytes) {
  std::copy(from.data() + at, from.data() + at + bytes, expected.begin() + static_cast<int64_t>(at));
}

template <typename T>
class Exchange {
 public:
  explicit Exchange(int64_t n) {
    const int64_t f = n % 9;  // three cases in nine without a fault, then each fault in turn
    fault_ = static_cast<Fault>(f < 3 ? 0 : f - 2);
    ++fault_cases[fault_];
    // A rejection needs another rank to tell.
    world_ = static_cast<int>(fault_ == kRejectDispatch || fault_ == kRejectCombine ? 2 + below(4) : 1 + below(5));
    ++by_world[world_];
    const int64_t local = 1 + below(3);
    // Now and then more than a warp's rows from one peer (unpack's ballot loop turns).
    c_.max_tokens = rng() % 4 == 0 ? pick({17, 24}) : pick({1, 2, 3, 5, 8});
    c_.num_experts = local * world_;
    c_.top_k = 1 + below(4);
    c_.row_bytes = rng() % 2 ? pick({1, 3, 7, 13, 17, 33, 101}) : 16 * pick({1, 2, 3, 5, 8});
    c_.model_dim = pick({1, 2, 3, 5, 8, 17, 64, 129});
    c_.dtype = dtype_of<T>();
    max_blocks_ = static_cast<int>(1 + below(3));
    sequence_ = static_cast<uint32_t>(rng() % 4 == 0 ? pick({0, 1, 0xfffffffe, 0xffffffff}) : rng());
    wrapped_sequences += sequence_ == 0xffffffffu;
    char text[200];
    std::snprintf(text, sizeof text, "world=%d E=%ld k=%ld max_tokens=%ld row_bytes=%ld M=%ld %s max_blocks=%d seq=%u "
                  "fault=%s", world_, c_.num_experts, c_.top_k, c_.max_tokens, c_.row_bytes, c_.model_dim,
                  name_of<T>(), max_blocks_, sequence_, fault_name(fault_));
    what_ = text;
    for (int r = 0; r < world_; ++r) ranks_.push_back(make_rank(r));
    model();
  }

  void run() {
    ++cases;
    pack();
    exchange();
    if (!unpack()) return;
    give_back();
    exchange();
    combine();
  }

 private:
  Rank& rank(int64_t r) { return *ranks_[static_cast<size_t>(r)]; }

  std::unique_ptr<Rank> make_rank(int r) {
    auto rank = std::make_unique<Rank>();
    Rank& k = *rank;
    k.l = layout_of(c_, world_, r);
    const LowLatencyLayout& l = k.l;
    k.num_tokens = rng() % 8 == 0 ? 0 : rng() % 3 == 0 ? l.max_tokens : 1 + below(l.max_tokens);
    zero_token_ranks += k.num_tokens == 0;
    k.index_dtype = rng() % 2 ? A2A_INT32 : A2A_INT64;
    const int64_t choices = k.num_tokens * l.top_k;
    const double unrouted = pick({0, 1, 3}) / 10.0, repeat = pick({0, 2, 4}) / 10.0;
    const int64_t hot = rng() % 3 == 0 ? below(world_) : -1;  // a peer that gets most rows
    k.indices64.resize(static_cast<size_t>(choices));
    for (int64_t c = 0; c < choices; ++c) {
      const int64_t j = c % l.top_k;
      int64_t e = hot >= 0 && uniform() < 0.8 ? hot * l.local_experts + below(l.local_experts) : below(l.num_experts);
      if (j > 0 && uniform() < repeat) e = k.indices64[static_cast<size_t>(c - 1 - below(j))];
      if (uniform() < unrouted) e = pick({-1, -1, -2, INT32_MIN, INT64_MIN});
      k.indices64[static_cast<size_t>(c)] = e;
    }
    k.clean64 = k.indices64;
    if (fault_ == kBadIndex && choices > 0 && (r == 0 || rng() % 2)) {
      // Not INT64_MAX: low_latency_cuda.cu's note() stores value + 1, which overflows int64 (signed
      // overflow, reported by UBSan).
      for (int bad = 0, n = static_cast<int>(1 + below(2)); bad < n; ++bad)
        k.indices64[static_cast<size_t>(below(choices))] =
            pick({l.num_experts, l.num_experts + 3, 2 * l.num_experts, INT32_MAX});
      for (int64_t c = 0; c < choices; ++c)
        if (k.indices64[static_cast<size_t>(c)] >= l.num_experts) {
          k.clean64[static_cast<size_t>(c)] = -1;
          if (k.first_bad < 0) k.first_bad = c, k.first_bad_value = k.indices64[static_cast<size_t>(c)];
        }
    }
    auto narrow = [](const std::vector<int64_t>& v) {
      std::vector<int32_t> out(v.size());
      for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] == INT64_MIN ? INT32_MIN : static_cast<int32_t>(v[i]);
      return out;
    };
    k.indices32 = narrow(k.indices64);
    k.clean32 = narrow(k.clean64);
    if (k.index_dtype == A2A_INT32)  // what the CPU and the model see: the int32 values
      for (size_t i = 0; i < k.clean64.size(); ++i) k.clean64[i] = k.clean32[i];

    const size_t x_shift = rng() % 2 ? 0 : static_cast<size_t>(below(16));
    k.x = guarded(static_cast<size_t>(k.num_tokens * l.row_bytes), x_shift);
    random_bytes(*k.x);
    k.x_before = snapshot(*k.x);
    ((l.row_bytes % 16 == 0 && x_shift == 0) ? vector_rows : byte_rows) += 1;

    // The workspaces: zeros before the first use, else what earlier calls
    // left (different on the two sides); the status record clear.
    k.gpu_ws = guarded(l.workspace_bytes, 0);
    k.cpu_ws = guarded(l.workspace_bytes, 0);
    if (rng() % 4 == 0) {
      std::memset(k.gpu_ws->data(), 0, l.workspace_bytes);
      std::memset(k.cpu_ws->data(), 0, l.workspace_bytes);
      ++fresh_workspaces;
    } else {
      random_bytes(*k.gpu_ws);
      random_bytes(*k.cpu_ws);
      std::memset(k.gpu_ws->data() + l.status, 0, sizeof(LowLatencyStatus));
      std::memset(k.cpu_ws->data() + l.status, 0, sizeof(LowLatencyStatus));
    }
    k.sent.assign(static_cast<size_t>(world_), -7);
    k.received.assign(static_cast<size_t>(world_), -7);
    return rank;
  }

  // The model of the whole exchange from the (clean) inputs.
  void model() {
    const int64_t L = c_.num_experts / world_;
    for (auto& rank_ptr : ranks_) {
      Rank& k = *rank_ptr;
      k.codes.assign(k.clean64.size(), -1);
      k.slots.assign(static_cast<size_t>(world_), {});
      for (int64_t t = 0; t < k.num_tokens; ++t)
        for (int64_t j = 0; j < c_.top_k; ++j) {
          const int64_t c = t * c_.top_k + j, e = k.clean64[static_cast<size_t>(c)];
          if (e < 0) {
            ++unrouted_choices;
            continue;
          }
          int64_t earlier = -1;
          for (int64_t i = 0; i < j && earlier < 0; ++i)
            if (k.clean64[static_cast<size_t>(t * c_.top_k + i)] == e) earlier = t * c_.top_k + i;
          if (earlier >= 0) {
            k.codes[static_cast<size_t>(c)] = k.codes[static_cast<size_t>(earlier)];
            ++repeated_choices;
            continue;
          }
          auto& slot = k.slots[static_cast<size_t>(e / L)];
          k.codes[static_cast<size_t>(c)] = (e / L) << 32 | static_cast<int64_t>(slot.size());
          slot.emplace_back(t, e % L);
        }
    }
    for (int d = 0; d < world_; ++d) {
      Rank& k = rank(d);
      k.experts.assign(static_cast<size_t>(L), {});
      k.arrivals.assign(static_cast<size_t>(world_ * k.l.slot_rows), -1);
      for (int s = 0; s < world_; ++s) {
        const auto& slot = rank(s).slots[static_cast<size_t>(d)];
        slots_over_a_warp += slot.size() > 32;
        for (size_t i = 0; i < slot.size(); ++i) {
          auto& list = k.experts[static_cast<size_t>(slot[i].second)];
          k.arrivals[static_cast<size_t>(s * k.l.slot_rows) + i] =
              slot[i].second * k.l.expert_capacity + static_cast<int64_t>(list.size());
          list.emplace_back(s, static_cast<int64_t>(i));
        }
      }
    }
  }

  // ---------------------------------------------------------------------
  // pack (or reject) on every rank

  void pack() {
    std::vector<int> rejecting;
    if (fault_ == kRejectDispatch) rejecting = pick_rejecting();
    for (int r = 0; r < world_; ++r) {
      Rank& k = rank(r);
      const LowLatencyLayout& l = k.l;
      const EsLaunch launch{nullptr, max_blocks_};
      const std::string what = what_ + " rank " + std::to_string(r);
      std::vector<unsigned char> expected = snapshot(*k.gpu_ws);
      k.rejects = std::find(rejecting.begin(), rejecting.end(), r) != rejecting.end();
      if (k.rejects) {
        gpu_op(what + " reject", {k.gpu_ws.get()},
               [&] { cuda_low_latency_reject(launch, l, kLowLatencyDispatch, sequence_, k.gpu_ws->as<char>()); });
        low_latency_reject_cpu(l, kLowLatencyDispatch, sequence_, k.cpu_ws->as<char>());
        for (int64_t p = 0; p < world_; ++p) {
          const LowLatencyHeader h = k.header(*k.cpu_ws, l.send, p);
          expect(h.kind == kLowLatencyDispatch && h.sequence == sequence_ && h.count == -1 && h.source == r,
                 "%s reject: the CPU's header to %ld is {%#x, %u, %d, %d}", what.c_str(), p, h.kind, h.sequence,
                 h.count, h.source);
          overlay(expected, *k.cpu_ws, l.send + static_cast<size_t>(p * l.slot_bytes), kHeader);
        }
        same_workspace(what + " reject", k, expected);
        continue;
      }
      gpu_op(what + " pack", {k.gpu_ws.get()}, [&] {
        cuda_low_latency_pack(launch, l, k.x->data(), k.num_tokens, k.gpu_indices(), k.index_dtype, sequence_,
                              k.gpu_ws->as<char>());
      });
      low_latency_pack_cpu(l, k.x->data(), k.num_tokens, k.cpu_indices(), k.index_dtype, sequence_,
                           k.cpu_ws->as<char>(), k.sent.data());
      grid_strided += k.num_tokens * l.top_k > max_blocks_;
      // The CPU against the model.
      for (int64_t p = 0; p < world_; ++p) {
        const auto& slot = k.slots[static_cast<size_t>(p)];
        rows_sent += static_cast<long long>(slot.size());
        const LowLatencyHeader h = k.header(*k.cpu_ws, l.send, p);
        expect(k.sent[p] == static_cast<int64_t>(slot.size()) && h.kind == kLowLatencyDispatch &&
                   h.sequence == sequence_ && h.count == static_cast<int32_t>(slot.size()) && h.source == r,
               "%s pack: the CPU's header to %ld is {%#x, %u, %d, %d}, sent %ld; %zu rows expected", what.c_str(), p,
               h.kind, h.sequence, h.count, h.source, k.sent[p], slot.size());
        const unsigned char* rows = k.cpu_ws->data() + l.send + p * l.slot_bytes + kHeader;
        for (size_t i = 0; i < slot.size(); ++i) {
          std::vector<unsigned char> want(static_cast<size_t>(l.dispatch_row), 0);
          std::memcpy(want.data(), k.x_before.data() + slot[i].first * l.row_bytes, static_cast<size_t>(l.row_bytes));
          const int32_t meta[4] = {static_cast<int32_t>(slot[i].first), static_cast<int32_t>(slot[i].second), 0, 0};
          std::memcpy(want.data() + l.dispatch_row - 16, meta, sizeof meta);
          const int64_t at = first_difference(rows + i * l.dispatch_row, want.data(), want.size());
          if (!expect(at < 0, "%s pack: the CPU's row %zu to %ld differs from the model at byte %ld", what.c_str(), i,
                      p, at))
            break;
        }
        overlay(expected, *k.cpu_ws, l.send + static_cast<size_t>(p * l.slot_bytes),
                static_cast<size_t>(kHeader + static_cast<int64_t>(slot.size()) * l.dispatch_row));
      }
      expect(std::equal(k.codes.begin(), k.codes.end(), reinterpret_cast<const int64_t*>(k.cpu_ws->data() + l.choices)),
             "%s pack: the CPU's choices differ from the model", what.c_str());
      overlay(expected, *k.cpu_ws, l.choices, k.codes.size() * 8);
      // The CUDA side: the CPU's bytes, its own elsewhere, and the status.
      LowLatencyStatus want{};
      if (k.first_bad >= 0) want.bad_choice = k.first_bad + 1, want.bad_value = k.first_bad_value + 1;
      std::memcpy(expected.data() + l.status, &want, sizeof want);
      expect(same_status(k.status(), want), "%s pack: status %s, %s expected", what.c_str(),
             status_text(k.status()).c_str(), status_text(want).c_str());
      same_workspace(what + " pack", k, expected);
      expect(unchanged(*k.x, k.x_before), "%s pack: changed x", what.c_str());
    }
  }

  std::vector<int> pick_rejecting() {
    std::vector<int> rejecting{static_cast<int>(below(world_))};
    if (world_ > 2 && rng() % 2) {
      const int other = static_cast<int>(below(world_));
      if (other != rejecting[0]) rejecting.push_back(other);
    }
    return rejecting;
  }

  // Every rank's send slot p, whole, into rank p's receive slot of that rank.
  void exchange() {
    for (int s = 0; s < world_; ++s)
      for (int d = 0; d < world_; ++d) {
        const LowLatencyLayout& l = rank(s).l;
        const size_t from = l.send + static_cast<size_t>(d * l.slot_bytes);
        const size_t to = l.recv + static_cast<size_t>(s * l.slot_bytes);
        std::memcpy(rank(d).gpu_ws->data() + to, rank(s).gpu_ws->data() + from, static_cast<size_t>(l.slot_bytes));
        std::memcpy(rank(d).cpu_ws->data() + to, rank(s).cpu_ws->data() + from, static_cast<size_t>(l.slot_bytes));
      }
  }

  // A receive slot's header of another call, on both sides: (rank, peer).
  std::pair<int, int> corrupt_header(uint32_t kind, uint32_t sequence) {
    const int d = static_cast<int>(below(world_)), p = static_cast<int>(below(world_));
    const LowLatencyLayout& l = rank(d).l;
    LowLatencyHeader h = rank(d).header(*rank(d).cpu_ws, l.recv, p);
    switch (rng() % 6) {
      case 0: h.sequence = sequence + 1; break;
      case 1: h.sequence = sequence - 1; break;
      case 2: h.kind = kind == kLowLatencyDispatch ? kLowLatencyCombine : kLowLatencyDispatch; break;
      case 3: h.kind = static_cast<uint32_t>(rng()); break;
      case 4: h.source = world_ == 1 ? 7 : (p + 1 + static_cast<int>(below(world_ - 1))) % world_; break;
      default: h.count = rng() % 2 ? static_cast<int32_t>(l.slot_rows + 1 + below(3)) : pick({-2, INT32_MIN}); break;
    }
    for (Guarded* ws : {rank(d).gpu_ws.get(), rank(d).cpu_ws.get()})
      std::memcpy(ws->data() + l.recv + p * l.slot_bytes, &h, sizeof h);
    return {d, p};
  }

  // After a CPU error on rank r (or none): the CUDA status it must meet.
  void expect_status(const std::string& what, Rank& k, a2a_status_t cpu_status, const std::string& message,
                     LowLatencyStatus want) {
    if (cpu_status != A2A_SUCCESS) ++cpu_errors_met;
    const LowLatencyStatus got = k.status();
    const bool agree = cpu_status == A2A_SUCCESS    ? got.rejected_by == 0 && got.mismatched_from == 0
                       : cpu_status == A2A_ERROR_REMOTE ? got.rejected_by != 0
                       : cpu_status == A2A_ERROR_MISMATCH ? got.rejected_by == 0 && got.mismatched_from != 0
                                                          : false;
    expect(agree, "%s: the CPU's error %d ('%s') and the CUDA status %s disagree", what.c_str(),
           static_cast<int>(cpu_status), message.c_str(), status_text(got).c_str());
    expect(same_status(got, want), "%s: status %s, %s expected", what.c_str(), status_text(got).c_str(),
           status_text(want).c_str());
  }

  // ---------------------------------------------------------------------
  // unpack on every rank that did not reject; false when the call ends here

  bool unpack() {
    int bad_rank = -1, bad_peer = -1;
    if (fault_ == kDispatchHeader) std::tie(bad_rank, bad_peer) = corrupt_header(kLowLatencyDispatch, sequence_);
    if (fault_ == kBadMeta) std::tie(bad_rank, bad_peer) = corrupt_meta();
    int first_rejecting = -1;
    for (int r = world_ - 1; r >= 0; --r)
      if (rank(r).rejects) first_rejecting = r;
    for (int r = 0; r < world_; ++r) {
      Rank& k = rank(r);
      if (k.rejects) continue;  // that rank's dispatch failed (INVALID_ARGUMENT) after the exchange
      const LowLatencyLayout& l = k.l;
      const std::string what = what_ + " rank " + std::to_string(r) + " unpack";
      const size_t recv_bytes = static_cast<size_t>(l.local_experts * l.expert_capacity * l.row_bytes);
      const size_t recv_shift = rng() % 2 ? 0 : static_cast<size_t>(below(16));
      k.gpu_recv = guarded(recv_bytes, recv_shift);
      k.cpu_recv = guarded(recv_bytes, recv_shift);
      k.gpu_counts = guarded(static_cast<size_t>(l.local_experts) * 8, 8 * static_cast<size_t>(below(2)));
      k.cpu_counts = guarded(k.gpu_counts->bytes(), 0);
      for (Guarded* g : {k.gpu_recv.get(), k.cpu_recv.get(), k.gpu_counts.get(), k.cpu_counts.get()}) random_bytes(*g);
      std::vector<unsigned char> expected = snapshot(*k.gpu_ws), recv_expected = snapshot(*k.gpu_recv);
      const EsLaunch launch{nullptr, max_blocks_};
      gpu_op(what, {k.gpu_ws.get(), k.gpu_recv.get(), k.gpu_counts.get()}, [&] {
        cuda_low_latency_unpack(launch, l, sequence_, k.gpu_ws->as<char>(), k.gpu_recv->data(),
                                k.gpu_counts->as<int64_t>());
      });
      std::string message;
      const a2a_status_t cpu_status = cpu_op(what, &message, [&] {
        low_latency_unpack_cpu(l, sequence_, k.cpu_ws->as<char>(), k.cpu_recv->data(), k.cpu_counts->as<int64_t>(),
                               k.received.data());
      });
      LowLatencyStatus want{};
      if (k.first_bad >= 0) want.bad_choice = k.first_bad + 1, want.bad_value = k.first_bad_value + 1;
      if (first_rejecting >= 0) {
        want.rejected_by = first_rejecting + 1;
        expect(cpu_status == A2A_ERROR_REMOTE &&
                   message.find(cat("rank(s) ", first_rejecting, " rejected")) != std::string::npos,
               "%s: the CPU's error %d '%s'; A2A_ERROR_REMOTE naming rank %d expected", what.c_str(),
               static_cast<int>(cpu_status), message.c_str(), first_rejecting);
      } else if (r == bad_rank) {
        want.mismatched_from = bad_peer + 1;
        expect(cpu_status == A2A_ERROR_MISMATCH && message.find(cat("rank ", bad_peer)) != std::string::npos,
               "%s: the CPU's error %d '%s'; A2A_ERROR_MISMATCH naming rank %d expected", what.c_str(),
               static_cast<int>(cpu_status), message.c_str(), bad_peer);
      } else {
        expect(cpu_status == A2A_SUCCESS, "%s: the CPU threw %d: %s", what.c_str(), static_cast<int>(cpu_status),
               message.c_str());
      }
      expect_status(what, k, cpu_status, message, want);
      if (cpu_status != A2A_SUCCESS) continue;
      // recv_counts, the counted rows of recv, and the counted rows' arrivals.
      const int64_t* counts = k.cpu_counts->as<int64_t>();
      for (int64_t e = 0; e < l.local_experts; ++e)
        expect(counts[e] == static_cast<int64_t>(k.experts[static_cast<size_t>(e)].size()),
               "%s: the CPU's recv_counts[%ld] = %ld, %zu expected", what.c_str(), e, counts[e],
               k.experts[static_cast<size_t>(e)].size());
      expect(std::equal(counts, counts + l.local_experts, k.gpu_counts->as<int64_t>()),
             "%s: recv_counts differ from the CPU's", what.c_str());
      for (int64_t e = 0; e < l.local_experts; ++e) {
        const auto& list = k.experts[static_cast<size_t>(e)];
        for (size_t i = 0; i < list.size(); ++i) {
          const auto [s, row] = list[i];
          const size_t at = static_cast<size_t>((e * l.expert_capacity + static_cast<int64_t>(i)) * l.row_bytes);
          const int64_t token = rank(s).slots[static_cast<size_t>(r)][static_cast<size_t>(row)].first;
          expect(std::equal(k.cpu_recv->data() + at, k.cpu_recv->data() + at + l.row_bytes,
                            rank(s).x_before.data() + token * l.row_bytes),
                 "%s: the CPU's recv row %zu of expert %ld is not token %ld of rank %ld", what.c_str(), i, e, token, s);
          overlay(recv_expected, *k.cpu_recv, at, static_cast<size_t>(l.row_bytes));
        }
      }
      const int64_t at = first_difference(k.gpu_recv->data(), recv_expected.data(), recv_expected.size());
      expect(at < 0, "%s: recv differs at byte %ld (expert %ld, row %ld, byte %ld)", what.c_str(), at,
             at / l.row_bytes / l.expert_capacity, at / l.row_bytes % l.expert_capacity, at % l.row_bytes);
      const int64_t* arrivals = reinterpret_cast<const int64_t*>(k.cpu_ws->data() + l.arrivals);
      for (int64_t s = 0; s < world_; ++s) {
        expect(k.received[s] == static_cast<int64_t>(rank(s).slots[static_cast<size_t>(r)].size()),
               "%s: the CPU received %ld rows from %ld, %zu expected", what.c_str(), k.received[s], s,
               rank(s).slots[static_cast<size_t>(r)].size());
        for (int64_t i = 0; i < k.received[s]; ++i)
          expect(arrivals[s * l.slot_rows + i] == k.arrivals[static_cast<size_t>(s * l.slot_rows + i)],
                 "%s: the CPU's arrival of row %ld from %ld is %ld, %ld expected", what.c_str(), i, s,
                 arrivals[s * l.slot_rows + i], k.arrivals[static_cast<size_t>(s * l.slot_rows + i)]);
        overlay(expected, *k.cpu_ws, l.arrivals + static_cast<size_t>(s * l.slot_rows) * 8,
                static_cast<size_t>(k.received[s]) * 8);
      }
      same_workspace(what, k, expected);
    }
    if (fault_ == kRejectDispatch || fault_ == kDispatchHeader || fault_ == kBadMeta) {
      read_statuses();
      return false;
    }
    return true;
  }

  // A received row's meta beyond the handle's (local expert or token), on both sides: (rank, peer).
  std::pair<int, int> corrupt_meta() {
    std::vector<std::pair<int, int>> slots;  // (rank, peer) with rows
    for (int d = 0; d < world_; ++d)
      for (int s = 0; s < world_; ++s)
        if (!rank(s).slots[static_cast<size_t>(d)].empty()) slots.emplace_back(d, s);
    if (slots.empty()) return {-1, -1};
    const auto [d, p] = slots[static_cast<size_t>(below(static_cast<int64_t>(slots.size())))];
    const LowLatencyLayout& l = rank(d).l;
    const int64_t row = below(static_cast<int64_t>(rank(p).slots[static_cast<size_t>(d)].size()));
    const size_t at =
        l.recv + static_cast<size_t>(p * l.slot_bytes + kHeader + row * l.dispatch_row + l.dispatch_row - 16);
    int32_t meta[2];
    std::memcpy(meta, rank(d).cpu_ws->data() + at, sizeof meta);
    switch (rng() % 4) {
      case 0: meta[1] = static_cast<int32_t>(l.local_experts + below(3)); break;
      case 1: meta[1] = pick({-1, INT32_MIN}); break;
      case 2: meta[0] = static_cast<int32_t>(l.max_tokens + below(3)); break;
      default: meta[0] = -1; break;
    }
    for (Guarded* ws : {rank(d).gpu_ws.get(), rank(d).cpu_ws.get()}) std::memcpy(ws->data() + at, meta, sizeof meta);
    return {d, p};
  }

  // ---------------------------------------------------------------------
  // return (or reject) on every rank

  void give_back() {
    std::vector<int> rejecting;
    if (fault_ == kRejectCombine) rejecting = pick_rejecting();
    for (int r = 0; r < world_; ++r) {
      Rank& k = rank(r);
      const LowLatencyLayout& l = k.l;
      const std::string what = what_ + " rank " + std::to_string(r);
      const EsLaunch launch{nullptr, max_blocks_};
      const size_t element = sizeof(T);
      k.expert_out = guarded(static_cast<size_t>(l.local_experts * l.expert_capacity * l.model_dim) * element,
                             element * static_cast<size_t>(pick({0, 0, 1, 3})));
      for (size_t i = 0; i < k.expert_out->bytes() / element; ++i) k.expert_out->as<T>()[i] = normal_value<T>();
      std::vector<unsigned char> expected = snapshot(*k.gpu_ws);
      k.rejects = std::find(rejecting.begin(), rejecting.end(), r) != rejecting.end();
      if (k.rejects) {
        gpu_op(what + " reject", {k.gpu_ws.get()},
               [&] { cuda_low_latency_reject(launch, l, kLowLatencyCombine, sequence_ + 1, k.gpu_ws->as<char>()); });
        low_latency_reject_cpu(l, kLowLatencyCombine, sequence_ + 1, k.cpu_ws->as<char>());
        for (int64_t p = 0; p < world_; ++p)
          overlay(expected, *k.cpu_ws, l.send + static_cast<size_t>(p * l.slot_bytes), kHeader);
        same_workspace(what + " reject", k, expected);
        continue;
      }
      const std::vector<unsigned char> out_before = snapshot(*k.expert_out);
      gpu_op(what + " return", {k.gpu_ws.get()},
             [&] { cuda_low_latency_return(launch, l, k.expert_out->data(), sequence_ + 1, k.gpu_ws->as<char>()); });
      low_latency_return_cpu(l, k.expert_out->data(), sequence_ + 1, k.cpu_ws->as<char>());
      const size_t out_row = static_cast<size_t>(l.model_dim) * element;
      for (int64_t p = 0; p < world_; ++p) {
        const int64_t count = k.received[p];
        const LowLatencyHeader h = k.header(*k.cpu_ws, l.send, p);
        expect(h.kind == kLowLatencyCombine && h.sequence == sequence_ + 1 && h.count == count && h.source == r,
               "%s return: the CPU's header to %ld is {%#x, %u, %d, %d}", what.c_str(), p, h.kind, h.sequence,
               h.count, h.source);
        const unsigned char* rows = k.cpu_ws->data() + l.send + p * l.slot_bytes + kHeader;
        for (int64_t i = 0; i < count; ++i) {
          std::vector<unsigned char> want(static_cast<size_t>(l.combine_row), 0);
          const int64_t arrival = k.arrivals[static_cast<size_t>(p * l.slot_rows + i)];
          std::memcpy(want.data(), out_before.data() + static_cast<size_t>(arrival) * out_row, out_row);
          if (!expect(std::equal(want.begin(), want.end(), rows + i * l.combine_row),
                      "%s return: the CPU's row %ld to %ld is not output row %ld", what.c_str(), i, p, arrival))
            break;
        }
        overlay(expected, *k.cpu_ws, l.send + static_cast<size_t>(p * l.slot_bytes),
                static_cast<size_t>(kHeader + count * l.combine_row));
      }
      same_workspace(what + " return", k, expected);
      expect(unchanged(*k.expert_out, out_before), "%s return: changed expert_out", what.c_str());
    }
  }

  // ---------------------------------------------------------------------
  // combine on every rank that did not reject

  void combine() {
    int bad_rank = -1, bad_peer = -1;
    if (fault_ == kCombineHeader) std::tie(bad_rank, bad_peer) = corrupt_header(kLowLatencyCombine, sequence_ + 1);
    int first_rejecting = -1;
    for (int r = world_ - 1; r >= 0; --r)
      if (rank(r).rejects) first_rejecting = r;
    for (int r = 0; r < world_; ++r) {
      Rank& k = rank(r);
      if (k.rejects) continue;
      const LowLatencyLayout& l = k.l;
      const std::string what = what_ + " rank " + std::to_string(r) + " combine";
      const int64_t choices = k.num_tokens * l.top_k;
      const int mode = static_cast<int>(rng() % 3);  // no gates, float32, the data's dtype
      std::vector<float> gates32(static_cast<size_t>(choices));
      std::vector<T> gates_data(static_cast<size_t>(choices));
      for (int64_t c = 0; c < choices; ++c) {
        gates32[static_cast<size_t>(c)] = static_cast<float>(std::normal_distribution<double>(0, 1)(rng));
        gates_data[static_cast<size_t>(c)] = normal_value<T>();
      }
      const void* gates = mode == 0   ? nullptr
                          : mode == 1 ? static_cast<const void*>(gates32.data())
                                      : static_cast<const void*>(gates_data.data());
      const a2a_dtype_t gate_dtype = mode == 2 ? dtype_of<T>() : A2A_FLOAT32;
      const size_t y_bytes = static_cast<size_t>(k.num_tokens * l.model_dim) * sizeof(T);
      const size_t y_shift = sizeof(T) * static_cast<size_t>(pick({0, 0, 1, 5}));
      k.y_gpu = guarded(y_bytes, y_shift);
      k.y_cpu = guarded(y_bytes, y_shift);
      random_bytes(*k.y_gpu);
      std::memcpy(k.y_cpu->data(), k.y_gpu->data(), y_bytes);
      const std::vector<unsigned char> expected = snapshot(*k.gpu_ws);
      const EsLaunch launch{nullptr, max_blocks_};
      gpu_op(what, {k.gpu_ws.get(), k.y_gpu.get()}, [&] {
        cuda_low_latency_combine(launch, l, k.num_tokens, gates, gate_dtype, sequence_ + 1, k.gpu_ws->as<char>(),
                                 k.y_gpu->data());
      });
      grid_strided += k.num_tokens * l.model_dim > 256 * max_blocks_;
      std::string message;
      const a2a_status_t cpu_status = cpu_op(what, &message, [&] {
        low_latency_combine_cpu(l, k.num_tokens, gates, gate_dtype, sequence_ + 1, k.cpu_ws->as<char>(),
                                k.y_cpu->data(), k.sent.data());
      });
      LowLatencyStatus want{};
      if (k.first_bad >= 0) want.bad_choice = k.first_bad + 1, want.bad_value = k.first_bad_value + 1;
      if (first_rejecting >= 0) {
        want.rejected_by = first_rejecting + 1;
        expect(cpu_status == A2A_ERROR_REMOTE &&
                   message.find(cat("rank(s) ", first_rejecting, " rejected")) != std::string::npos,
               "%s: the CPU's error %d '%s'; A2A_ERROR_REMOTE naming rank %d expected", what.c_str(),
               static_cast<int>(cpu_status), message.c_str(), first_rejecting);
      } else if (r == bad_rank) {
        want.mismatched_from = bad_peer + 1;
        expect(cpu_status == A2A_ERROR_MISMATCH && message.find(cat("rank ", bad_peer)) != std::string::npos,
               "%s: the CPU's error %d '%s'; A2A_ERROR_MISMATCH naming rank %d expected", what.c_str(),
               static_cast<int>(cpu_status), message.c_str(), bad_peer);
      } else {
        expect(cpu_status == A2A_SUCCESS, "%s: the CPU threw %d: %s", what.c_str(), static_cast<int>(cpu_status),
               message.c_str());
      }
      expect_status(what, k, cpu_status, message, want);
      // Only the status record changes in the workspace.
      std::vector<unsigned char> with_status = expected;
      std::memcpy(with_status.data() + l.status, &want, sizeof want);
      same_workspace(what, k, with_status);
      if (cpu_status != A2A_SUCCESS) continue;
      // y: the CPU's bits, and the model's.
      std::vector<T> model(static_cast<size_t>(k.num_tokens * l.model_dim));
      for (int64_t t = 0; t < k.num_tokens; ++t)
        for (int64_t m = 0; m < l.model_dim; ++m) {
          using Acc = typename Num<T>::Acc;
          Acc sum = Acc(0);
          for (int64_t j = 0; j < l.top_k; ++j) {
            const int64_t c = t * l.top_k + j, code = k.codes[static_cast<size_t>(c)];
            if (code < 0) continue;
            const Rank& d = rank(code >> 32);
            const int64_t row = d.arrivals[static_cast<size_t>(r * l.slot_rows + (code & 0xffffffff))];
            const Acc g = mode == 0   ? Acc(1)
                          : mode == 1 ? static_cast<Acc>(gates32[static_cast<size_t>(c)])
                                      : Num<T>::load(gates_data[static_cast<size_t>(c)]);
            sum += g * Num<T>::load(d.expert_out->as<T>()[row * l.model_dim + m]);
            rows_combined += m == 0;
          }
          model[static_cast<size_t>(t * l.model_dim + m)] = Num<T>::store(sum);
        }
      int64_t at = first_difference(k.y_cpu->data(), reinterpret_cast<const unsigned char*>(model.data()), y_bytes);
      expect(at < 0, "%s: the CPU's y differs from the model at element %ld", what.c_str(),
             at / static_cast<int64_t>(sizeof(T)));
      at = first_difference(k.y_gpu->data(), k.y_cpu->data(), y_bytes);
      expect(at < 0, "%s: y differs from the CPU's at element %ld (token %ld)", what.c_str(),
             at / static_cast<int64_t>(sizeof(T)), at / static_cast<int64_t>(sizeof(T)) / l.model_dim);
    }
    read_statuses();
  }

  // The status record of every rank, then
  // through cuda_low_latency_status, which must return it and clear it.
  void read_statuses() {
    for (int r = 0; r < world_; ++r) {
      Rank& k = rank(r);
      const LowLatencyStatus record = k.status();
      const std::string what = what_ + " rank " + std::to_string(r) + " status";
      LowLatencyStatus got{};
      std::string error;
      try {
        got = cuda_low_latency_status(EsLaunch{nullptr, max_blocks_}, k.l, k.gpu_ws->as<char>(), 10.0);
      } catch (const Failure& failure) {
        error = failure.what();
      }
      ++checks;
      if (!error.empty()) fail("%s: cuda_low_latency_status threw: %s", what.c_str(), error.c_str());
      expect(same_status(got, record), "%s: cuda_low_latency_status returned %s, the record is %s", what.c_str(),
             status_text(got).c_str(), status_text(record).c_str());
      expect(same_status(k.status(), LowLatencyStatus{}), "%s: cuda_low_latency_status left %s", what.c_str(),
             status_text(k.status()).c_str());
      expect(k.gpu_ws->guards_intact(), "%s: wrote outside the workspace", what.c_str());
      expect(unchanged(*k.x, k.x_before), "%s: changed x", what.c_str());
    }
  }

  Config c_{};
  int world_ = 1, max_blocks_ = 1;
  uint32_t sequence_ = 0;
  Fault fault_ = kNone;
  std::string what_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = arguments(argc, argv, 20);
  for (int64_t i = 0; i < n; ++i) {
    switch (i % 4) {
      case 0: Exchange<float>(i).run(); break;
      case 1: Exchange<half_t>(i).run(); break;
      case 2: Exchange<bfloat16_t>(i).run(); break;
      default: Exchange<double>(i).run(); break;
    }
  }
  std::printf("ranks per case 1..5: %lld %lld %lld %lld %lld; ranks with no token: %lld; choices unrouted %lld, "
              "repeating an expert %lld; rows sent %lld (slots of over 32 rows %lld), summed %lld; x rows by 16-byte "
              "vectors in %lld ranks, by bytes in %lld; grid-stride loops %lld; sequences wrapping %lld; fresh "
              "workspaces %lld\n",
              by_world[1], by_world[2], by_world[3], by_world[4], by_world[5], zero_token_ranks, unrouted_choices,
              repeated_choices, rows_sent, slots_over_a_warp, rows_combined, vector_rows, byte_rows, grid_strided,
              wrapped_sequences, fresh_workspaces);
  std::printf("faults: none %lld, bad index %lld, dispatch rejected %lld, dispatch header %lld, bad meta %lld, "
              "combine rejected %lld, combine header %lld; CPU errors met by the CUDA status: %lld\n",
              fault_cases[kNone], fault_cases[kBadIndex], fault_cases[kRejectDispatch], fault_cases[kDispatchHeader],
              fault_cases[kBadMeta], fault_cases[kRejectCombine], fault_cases[kCombineHeader], cpu_errors_met);
  return summary("low_latency_cuda");
}
