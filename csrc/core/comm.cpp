#include "core/comm.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include "core/algorithms.hpp"

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace a2a {

namespace {

// How long destroying a communicator (or growing its scratch) waits for its
// stream before aborting.
constexpr double kDestroyWaitS = 30.0;

CommParts single_transport(std::unique_ptr<Transport> transport, std::unique_ptr<Device> device) {
  CommParts parts;
  parts.device = std::move(device);
  parts.data = parts.control = transport.get();
  parts.transports.push_back(std::move(transport));
  return parts;
}

}  // namespace

Comm::Comm(std::unique_ptr<Transport> transport, std::unique_ptr<Device> device, Topology topology,
           bool use_strided_spans)
    : Comm(single_transport(std::move(transport), std::move(device)), std::move(topology), use_strided_spans) {}

Comm::Comm(CommParts parts, Topology topology, bool use_strided_spans)
    : device_(std::move(parts.device)),
      transports_(std::move(parts.transports)),
      counted_data_(std::make_unique<CountingTransport>(*parts.data, counters_, CountingTransport::Path::kData)),
      counted_control_(
          std::make_unique<CountingTransport>(*parts.control, counters_, CountingTransport::Path::kControl)),
      data_(counted_data_.get()),
      control_(counted_control_.get()),
      control_waits_for_stream_(parts.control_waits_for_stream),
      device_type_(parts.device_type),
      transport_kind_(parts.transport),
      topology_(std::move(topology)),
      use_strided_spans_(use_strided_spans && data_->supports_strided()),
      in_band_(parts.data == parts.control && data_->supports_signed_exchange()),
      cross_check_(parts.cross_check),
      // One rank has nobody to disagree with: it checks nothing (agree()).
      predicts_(parts.predicts_check && !in_band_ && cross_check_ && control_->supports_labelled_check() &&
                topology_.size > 1),
      host_scratch_(*device_, DeviceBuffer::Kind::kHost),
      splitter_(std::move(parts.splitter)) {
  device_->attach_counters(&counters_);
  call_gate_.set_counters(&counters_);
}

Comm::~Comm() {
  // Work still on the stream may be a NCCL kernel waiting for a peer that
  // never comes; freeing buffers would then wait for it forever. Give it a
  // bounded while, then abort the transports to release it.
  try {
    device_->synchronize(kDestroyWaitS, [this] { data_->check_async_error(); });
  } catch (...) {
    abort_transports();
  }
  // The posted check's messages must not outlive the comm: Open MPI reuses a
  // freed context for the next communicator, where a late message of this
  // one would be taken for one of its own (found on 2026-11-29: a
  // communicator made after one freed with its check posted received one
  // message out of place). Every rank posted one for its last call, so the
  // wait is short; a disagreement found now has no call left to raise in.
  if (posted_.open && broken_reason_.empty()) {
    posted_.open = false;
    try {
      control_->complete_check(nullptr);
    } catch (...) {
    }
  }
  counted_data_.reset();
  counted_control_.reset();
  while (!transports_.empty()) transports_.pop_back();  // wrappers before what they wrap
}

void Comm::require_control_outside_capture(const char* op) const {
  if (control_waits_for_stream_ && device_->capturing())
    fail(A2A_ERROR_UNSUPPORTED, op, " on rank ", rank(), ": this communicator (made from a NCCL unique id) exchanges "
         "host values by waiting for the stream, which cannot happen while it is being captured into a CUDA graph; "
         "do this outside the capture (e.g. plan all_to_all_v first)");
}

void Comm::set_stream(void* stream) {
  device_->set_stream(stream);
  for (auto& transport : transports_) transport->set_stream(stream);
}

char* Comm::host_scratch(size_t bytes) { return host_scratch_.reserve(bytes, kDestroyWaitS); }

void Comm::mark_broken(const std::string& why) {
  if (broken_reason_.empty()) broken_reason_ = why;
  posted_.open = false;  // its transports were aborted: nothing to complete
}

void Comm::check_usable(const char* op) const {
  if (!broken_reason_.empty())
    fail(A2A_ERROR_TRANSPORT, op, " on rank ", rank(),
         ": this communicator is unusable after an earlier failure (", broken_reason_,
         "); create a new one");
  // A Disagreement, so that run() does not retire the comm for it: nothing was sent.
  if (!started_op_.empty())
    throw Disagreement(A2A_ERROR_INVALID_ARGUMENT,
                       cat(op, " on rank ", rank(), ": the ", started_op_,
                           " started on this communicator is not finished; finish it (a2a_all_to_all_v_finish) or "
                           "drop it (a2a_all_to_all_v_drop) first"));
}

namespace {

std::string describe(const char* name, int64_t value) {
  if (std::strcmp(name, "dtype") == 0) return dtype_name(value);
  if (std::strcmp(name, "algo") == 0) return algo_name(value);
  if (std::strcmp(name, "reduce_op") == 0) return value == A2A_SUM ? "sum" : value == A2A_MAX ? "max" : value == A2A_MIN ? "min" : "invalid-op";
  if (std::strcmp(name, "capacity_setting") == 0) {  // a float64 carried as its bits
    double setting;
    std::memcpy(&setting, &value, sizeof setting);
    return cat(setting);
  }
  return std::to_string(value);
}

constexpr size_t kMaxFields = 24;
constexpr size_t kOpBytes = 40;

// What every rank contributes to the argument check; the same size on every
// rank whatever the collective, so that ranks calling different collectives
// still meet in one allgather.
struct Signature {
  int64_t rejected;  // 1 when this rank rejected its own input
  int64_t sequence;  // Comm::sequence() of this call
  int64_t enqueued;  // 1 when this rank predicted the call and enqueued its data (set for the verdict only)
  int64_t fields[kMaxFields];
  // A 16-bit tag of each field's name (0: no field): a field compared by position means something only where
  // the names agree (one op called with a plan on one rank and counts on another differs here).
  uint16_t names[kMaxFields];
  char op[kOpBytes];
};

// A field name's tag: FNV-1a folded to 16 bits, never 0 (no field).
uint16_t name_tag(const char* name) {
  uint32_t hash = 2166136261u;
  for (const char* c = name; *c != '\0'; ++c) hash = (hash ^ static_cast<unsigned char>(*c)) * 16777619u;
  const auto tag = static_cast<uint16_t>(hash ^ (hash >> 16));
  return tag == 0 ? 1 : tag;
}

Signature make_signature(const char* op, const std::vector<Field>& fields, bool rejected, int64_t sequence) {
  if (fields.size() > kMaxFields) fail(A2A_ERROR_INTERNAL, op, ": too many fields to agree on");
  Signature mine{};
  mine.rejected = rejected ? 1 : 0;
  mine.sequence = sequence;
  for (size_t i = 0; i < fields.size(); ++i) {
    mine.fields[i] = fields[i].value;
    mine.names[i] = name_tag(fields[i].name);
  }
  std::strncpy(mine.op, op, kOpBytes - 1);
  return mine;
}

// The digest of a signature: a 64-bit multiply-xorshift hash over its 64-bit
// words. Equal digests mean equal (op, fields, rejected, sequence) but for a
// collision.
uint64_t signature_digest(const Signature& signature) {
  static_assert(sizeof(Signature) % sizeof(uint64_t) == 0, "Signature is hashed as 64-bit words");
  uint64_t words[sizeof(Signature) / sizeof(uint64_t)];
  std::memcpy(words, &signature, sizeof words);
  uint64_t hash = 0x9e3779b97f4a7c15ull;
  for (uint64_t word : words) {
    hash = (hash ^ word) * 0xff51afd7ed558ccdull;
    hash ^= hash >> 32;
  }
  return hash;
}

// The digest of a call that no rank rejected: its op, fields and place in
// the sequence (0 for the predictor's key, which names the call, not its place).
uint64_t call_digest(const char* op, const std::vector<Field>& fields, int64_t sequence) {
  return signature_digest(make_signature(op, fields, false, sequence));
}

// The label of one labelled exchange: the call's digest and the exchange's
// index (kCheckRound for agree()'s empty round), folded to 32 bits, so that
// the exchanges of one call, and an empty round and a call's data, never
// look alike.
constexpr uint64_t kCheckRound = 1ull << 32;
constexpr uint64_t kPostedCheck = kCheckRound + 1;  // the posted check of a predicted call

uint32_t exchange_label(uint64_t signature, uint64_t index) {
  uint64_t hash = (signature ^ ((index + 1) * 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull;
  hash ^= hash >> 32;
  return static_cast<uint32_t>(hash ^ (hash >> 29));
}

template <typename... Args>
[[noreturn]] void disagree(a2a_status_t status, Args&&... args) {
  throw Disagreement(status, cat(std::forward<Args>(args)...));
}

// Every rank holds every signature, so every rank reaches the same verdict.
// Returns only when all ranks agree and none rejected its input. `data_moved`:
// the check travelled with the data (Comm::agree_in_exchange), which the
// agreeing ranks may already have written to their outputs.
void verdict(int rank, int size, const char* op, const std::vector<Field>& fields, const std::string& local_error,
             a2a_status_t local_status, const Signature& mine, const std::vector<Signature>& all, bool data_moved) {
  std::string rejecting;
  for (int r = 0; r < size; ++r)
    if (all[r].rejected) rejecting += cat(rejecting.empty() ? "" : ", ", r);
  if (!local_error.empty()) disagree(local_status, local_error);
  if (!rejecting.empty())
    disagree(A2A_ERROR_REMOTE, op, " on rank ", rank, ": rank(s) ", rejecting,
         " rejected their input (see the error on those ranks); ",
             data_moved ? "the output may hold what the other ranks sent" : "no data was exchanged");
  for (int r = 0; r < size; ++r) {
    if (std::strncmp(all[r].op, mine.op, kOpBytes) == 0) continue;
    std::string detail;
    for (int q = 0; q < size; ++q) detail += cat(q > 0 ? ", " : "", "rank ", q, ": ", all[q].op);
    disagree(A2A_ERROR_MISMATCH, op, " on rank ", rank,
         ": ranks called different collectives on the same communicator at the same time (", detail, ")");
  }
  // Fields are compared by position, up to the first whose name differs on some rank (or that some rank has
  // and this one lacks): from there on the ranks passed different kinds of arguments.
  for (size_t i = 0; i < kMaxFields; ++i) {
    std::string other_kinds;
    for (int r = 0; r < size; ++r)
      if (all[r].names[i] != mine.names[i]) other_kinds += cat(other_kinds.empty() ? "" : ", ", r);
    if (!other_kinds.empty()) {
      std::string names;
      for (const Field& field : fields) names += cat(names.empty() ? "" : ", ", field.name);
      disagree(A2A_ERROR_MISMATCH, op, " on rank ", rank, ": ranks called ", op, " with different kinds of ",
               "arguments (this rank's: ", names, "; rank(s) ", other_kinds, " passed another kind: a plan where this ",
               "rank passed counts, say)");
    }
    if (i >= fields.size()) continue;
    bool equal = true;
    for (int r = 0; r < size; ++r) equal &= all[r].fields[i] == mine.fields[i];
    if (equal) continue;
    std::string detail;
    for (int r = 0; r < size; ++r)
      detail += cat(r > 0 ? ", " : "", "rank ", r, ": ", describe(fields[i].name, all[r].fields[i]));
    std::string context;
    for (const auto& f : fields) context += cat(" ", f.name, "=", describe(f.name, f.value));
    throw FieldDisagreement(A2A_ERROR_MISMATCH,
                            cat(op, " on rank ", rank, ": '", fields[i].name, "' differs across ranks (", detail,
                                "); this rank has", context),
                            fields[i].name);
  }
  for (int r = 0; r < size; ++r) {
    if (all[r].sequence == mine.sequence) continue;
    std::string detail;
    for (int q = 0; q < size; ++q) detail += cat(q > 0 ? ", " : "", "rank ", q, ": #", all[q].sequence);
    disagree(A2A_ERROR_MISMATCH, op, " on rank ", rank, ": ranks are at different calls on this communicator (", detail,
         "); a rank skipped or added a collective");
  }
}

}  // namespace

void Comm::agree(const char* op, const std::vector<Field>& fields, const std::string& input_error) {
  check_usable(op);
  check_posted(op);
  ++sequence_;
  count(&counters_, Count::kCollectives);
  std::string local_error = input_error;
  // Asked of the device only where it matters (a CUDA query per call).
  const bool capturing = (!data_->supports_capture() || control_waits_for_stream_) && device_->capturing();
  // A transport that waits for the stream cannot be captured: refused like bad
  // input (every rank hears of it), with its own status.
  const bool capture_refused = local_error.empty() && !data_->supports_capture() && capturing;
  const a2a_status_t local_status = capture_refused ? A2A_ERROR_UNSUPPORTED : A2A_ERROR_INVALID_ARGUMENT;
  if (capture_refused)
    local_error = cat(op, " on rank ", rank(), ": the ", data_->name(), " transport waits for the stream, which cannot "
                      "happen while it is being captured into a CUDA graph; capture with a NCCL communicator instead");
  if (fields.size() > kMaxFields) fail(A2A_ERROR_INTERNAL, op, ": too many fields to agree on");
  // Nobody to disagree with; or the check would wait for a stream that is
  // being captured into a CUDA graph (then only local checks run).
  if (size() == 1 || !cross_check_ || (control_waits_for_stream_ && capturing)) {
    if (!local_error.empty()) disagree(local_status, local_error);
    return;
  }
  if (in_band_) {
    // A rank that rejected its input sends nothing but the notices of the
    // settle, which end the other ranks' exchanges.
    if (!local_error.empty()) settle_and_explain(op, fields, local_error, local_status, -1, false);
    agree_in_band(op, fields);
    return;
  }
  if (predicts_) {
    agree_predicted(op, fields, local_error, local_status);
    return;
  }
  gather_verdict(op, fields, local_error, local_status, false);
}

void Comm::gather_verdict(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                          a2a_status_t local_status, bool data_moved, const PostedCall* posted) {
  Signature mine = make_signature(op, fields, !local_error.empty(), posted ? posted->sequence : sequence_);
  mine.enqueued = posted ? 1 : 0;
  std::vector<Signature> all(size());
  count(&counters_, Count::kCheckRounds);
  run(op, [&] { control_->allgather(&mine, all.data(), sizeof(Signature)); });
  bool enqueued = false;
  for (const Signature& signature : all) enqueued |= signature.enqueued != 0;
  if (!enqueued) {
    verdict(rank(), size(), op, fields, local_error, local_status, mine, all, data_moved);
    return;
  }
  // Ranks that predicted the call enqueued its data, which waits for the
  // ranks that left it and can never be withdrawn: the verdict retires the
  // comm on every rank (the NCCL communicator is aborted).
  std::string message;
  a2a_status_t status = A2A_ERROR_MISMATCH;
  try {
    verdict(rank(), size(), op, fields, local_error, local_status, mine, all, data_moved);
    message = cat(op, " on rank ", rank(), ": a peer's check differed from this rank's with equal arguments (a "
                  "32-bit signature collision or a damaged message)");
  } catch (const Failure& e) {
    status = e.status();
    message = e.what();
  }
  message += cat(posted ? posted->found : "",
                 "; the ranks that predicted this call had enqueued its data, which waits for the ranks that left it: "
                 "this communicator is retired on every rank, create a new one");
  abort_transports();
  mark_broken(message);
  throw Failure(status, message);
}

void Comm::agree_predicted(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                           a2a_status_t local_status) {
  // A call made by the call just before (a one-shot all_to_all_v's plan) is
  // known as such, so that the key repeats; any other by its number. Both
  // name one call on every rank: each call starts after the check of the
  // one before completed, so every rank is at the same sequence.
  std::vector<Field> keyed = fields;
  for (Field& field : keyed)
    if (field.is_call && field.value == sequence_ - 1) field.value = -1;
  const uint64_t key = call_digest(op, keyed, 0);
  uint64_t predicted = 0;
  if (local_error.empty() && predictor_.predict(&predicted) && predicted == key) {
    // Every rank predicted this call. One that calls another makes a round
    // of its own label instead, finds this one there, and raises; this rank
    // finds its label here at its next call (or in a wait before).
    const uint32_t label = exchange_label(call_digest(op, fields, sequence_), kPostedCheck);
    run(op, [&] { control_->post_check(world_group(topology_), label); });
    posted_ = PostedCall{op, fields, sequence_, true};
    predictor_.push(key);
    return;
  }
  // A round: a call that was not predicted (or rejected its input) waits for
  // every rank's label, so that nothing is enqueued unless all agree.
  if (!local_error.empty()) settle_and_explain(op, fields, local_error, local_status, -1, false);
  agree_in_band(op, fields);
  predictor_.push(key);
}

void Comm::check_posted(const char* op) {
  check_usable(op);
  if (!posted_.open) return;
  posted_.open = false;
  bool agreed = false;
  int member = -1;
  try {
    agreed = control_->complete_check(&member);
  } catch (const PostedCheckFailed& e) {
    member = e.member();
  } catch (...) {
    retire(op);
  }
  if (!agreed) explain_posted(op, member, cat("at the next call on this communicator, ", op));
}

void Comm::explain_posted(const char* op, int member, const std::string& when) {
  count(&counters_, Count::kCheckRounds);
  PostedCall posted = posted_;
  posted_.open = false;
  posted.found = cat(" (found ", when, ")");
  const char* posted_op = posted.op.c_str();
  run(posted_op, [&] { control_->settle_disagreement(); });
  // Its data was enqueued: what the agreeing peers sent may have arrived.
  gather_verdict(posted_op, posted.fields, "", A2A_ERROR_INVALID_ARGUMENT, true, &posted);
  fail(A2A_ERROR_INTERNAL, op, ": the posted check of ", posted_op, " found rank ", member,
       " outside the call, and no verdict was reached");
}

// On an in-band comm a call whose messages cannot carry the check (the dense
// reductions, route, split) runs one round of empty labelled messages over
// the world; a rank in another call sees the label of its first message, or
// its notice.
void Comm::agree_in_band(const char* op, const std::vector<Field>& fields) {
  const uint64_t signature = call_digest(op, fields, sequence_);
  const Span nothing = Span::contiguous(nullptr, 0);
  bool agreed = false;
  int disagreeing = -1;
  count(&counters_, Count::kCheckRounds);
  run(op, [&] {
    agreed = control_->signed_exchange(
        world_group(topology_), exchange_label(signature, kCheckRound), 1, [&](int, size_t) { return nothing; },
        [&](int, size_t) { return nothing; }, &disagreeing);
  });
  if (!agreed) settle_and_explain(op, fields, "", A2A_ERROR_INVALID_ARGUMENT, disagreeing, false);
}

InBandCheck Comm::begin_in_band(const char* op, std::vector<Field> fields) {
  if (!in_band_ || !cross_check_) fail(A2A_ERROR_INTERNAL, op, ": begin_in_band on a comm that does not check in band");
  check_usable(op);
  ++sequence_;
  count(&counters_, Count::kCollectives);
  InBandCheck check{op, std::move(fields)};
  check.signature = call_digest(op, check.fields, sequence_);
  return check;
}

void Comm::exchange_in_band(InBandCheck& check, Transport& transport, const PeerGroup& group, size_t pieces,
                            const std::function<Span(int, size_t)>& send_piece,
                            const std::function<Span(int, size_t)>& recv_piece) {
  const uint32_t label = exchange_label(check.signature, static_cast<uint64_t>(check.exchanges++));
  bool agreed = false;
  int member = -1;
  run(check.op, [&] { agreed = transport.signed_exchange(group, label, pieces, send_piece, recv_piece, &member); });
  if (!agreed)
    settle_and_explain(check.op, check.fields, "", A2A_ERROR_INVALID_ARGUMENT, member < 0 ? -1 : group.member(member),
                       true);
}

// Every rank comes here: one that found a disagreement, and every other,
// which finds one in the notices of the first (no rank completes a call in
// which two ranks disagree: begin_in_band). The settle leaves no message of
// the call anywhere; then one allgather of Signatures gives every rank the
// same detailed verdict.
void Comm::settle_and_explain(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                              a2a_status_t local_status, int disagreeing_rank, bool data_moved) {
  count(&counters_, Count::kCheckRounds);
  run(op, [&] { control_->settle_disagreement(); });
  gather_verdict(op, fields, local_error, local_status, data_moved);
  disagree(A2A_ERROR_MISMATCH, op, " on rank ", rank(), ": the messages of rank ", disagreeing_rank,
           " differ in size from what this rank expects, with equal arguments (a 32-bit signature collision or a "
           "damaged message)");
}

// The labelled messages are the data itself, received straight into the
// caller's buffers: one round, no copy. A disagreement is found only once the
// messages arrived, so `recv` may then hold what the agreeing peers sent (as
// after any failed MPI call); the error still reaches every rank. (Until
// 2026-11 small messages landed in scratch and large ones waited behind an
// empty signed round, to leave `recv` untouched: a copy, or a round, on every
// call; docs/benchmarks.md, "The small-message path".)
void Comm::agree_in_exchange(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                             Transport& transport, const std::function<Span(int)>& send_span,
                             const std::function<Span(int)>& recv_span) {
  const PeerGroup world = world_group(topology_);
  if (!in_band_ || !cross_check_ || !local_error.empty() || size() == 1) {
    agree(op, fields, local_error);
    run(op, [&] { exchange(transport, world, send_span, recv_span); });
    return;
  }
  InBandCheck check = begin_in_band(op, fields);
  exchange_in_band(
      check, transport, world, 1, [&](int i, size_t) { return send_span(i); },
      [&](int j, size_t) { return recv_span(j); });
}

std::vector<int64_t> Comm::start_in_band(const char* op, const std::vector<Field>& fields,
                                         const std::function<Span(int)>& send_span, size_t unit) {
  if (!in_band_) fail(A2A_ERROR_INTERNAL, op, ": start_in_band on a comm that cannot check in band");
  check_usable(op);
  ++sequence_;
  count(&counters_, Count::kCollectives);
  const uint64_t signature = call_digest(op, fields, sequence_);
  std::vector<int64_t> sizes;
  run(op, [&] { sizes = data_->signed_start(exchange_label(signature, 0), send_span); });
  int disagreeing = -1;
  for (int r = 0; r < size() && disagreeing < 0; ++r)
    if (sizes[r] == Transport::kOtherLabel || (unit != 0 && sizes[r] % static_cast<int64_t>(unit) != 0))
      disagreeing = r;
  if (disagreeing < 0) {
    started_op_ = op;
    return sizes;
  }
  if (!cross_check_) {
    // The other ranks may not be in this call, or in any settle: what this
    // one sent and received may be left anywhere, so the comm is retired.
    run(op, [&] {
      fail(A2A_ERROR_MISMATCH, op, " on rank ", rank(), ": the message of rank ", disagreeing, " belongs to another "
           "call (the cross-rank check is off, so the ranks' arguments were not compared)");
    });
  }
  settle_and_explain(op, fields, "", A2A_ERROR_INVALID_ARGUMENT, disagreeing, false);
}

void Comm::finish_in_band(const char* op, const std::function<Span(int)>& recv_span) {
  if (started_op_.empty()) fail(A2A_ERROR_INTERNAL, op, ": finish_in_band without start_in_band");
  started_op_.clear();
  run(op, [&] { data_->signed_finish(recv_span); });
}

void Comm::drop_in_band(const char* op) {
  const Span nothing = Span::contiguous(nullptr, 0);
  finish_in_band(op, [&](int) { return nothing; });
}

std::unique_ptr<Comm> Comm::split(int color, int key) {
  const char* op = "split";
  if (!splitter_)
    fail(A2A_ERROR_UNSUPPORTED, op, " on rank ", rank(), ": this communicator cannot make sub-communicators");
  // Creating communicators waits for peers on the host, which cannot happen
  // while this comm's stream is being captured into a CUDA graph (refused on
  // every rank alike, as every rank captures or none does).
  if (device_->capturing())
    fail(A2A_ERROR_UNSUPPORTED, op, " on rank ", rank(), ": cannot create a communicator while the stream is being "
         "captured into a CUDA graph; split before the capture");
  std::string local_error;
  if (color < 0 && color != A2A_UNDEFINED)
    local_error = cat(op, " on rank ", rank(), " of ", size(), ": color ", color, " is negative; pass a color >= 0, "
                      "or A2A_UNDEFINED (", A2A_UNDEFINED, ") for a rank that joins no new communicator");
  // The check's round and the gather stay two: a rank whose check timed out
  // has sent its first round, so a rank that comes late would complete a
  // gather folded into it and then wait in the backends' split (unbounded)
  // for a rank that gave up; the second round times out there instead.
  agree(op, {}, local_error);

  const SplitEntry mine{color, key, topology_.node};
  std::vector<SplitEntry> entries(size());
  run(op, [&] { control_->allgather(&mine, entries.data(), sizeof(SplitEntry)); });
  const Topology topology = color == A2A_UNDEFINED ? Topology() : split_topology(entries, rank());

  // The backends' split makes the same collective calls on every rank before
  // anything can fail locally; then every rank learns whether all succeeded,
  // so that none keeps a communicator that a peer lacks.
  std::unique_ptr<Comm> child;
  a2a_status_t status = A2A_SUCCESS;
  std::string error;
  try {
    child = splitter_->split(*this, color, topology);
  } catch (const Failure& e) {
    status = e.status();
    error = e.what();
  } catch (const std::exception& e) {
    status = A2A_ERROR_INTERNAL;
    error = cat("internal error: ", e.what());
  }
  int64_t failed = error.empty() ? 0 : 1;
  try {
    run(op, [&] { control_->allreduce_int64(&failed, 1, ReduceOp::kMax); });
  } catch (const Failure&) {
    if (error.empty()) throw;  // else this rank's own failure says more
  }
  if (!error.empty()) {
    child.reset();
    const std::string message = cat(op, " on rank ", rank(), " of ", size(), ": ", error);
    // Messages of the backends' split may still be in flight.
    if (status == A2A_ERROR_TIMEOUT || status == A2A_ERROR_TRANSPORT) {
      abort_transports();
      mark_broken(message);
    }
    throw Failure(status, message);
  }
  if (failed != 0)
    fail(A2A_ERROR_REMOTE, op, " on rank ", rank(), " of ", size(), ": another rank could not create its new "
         "communicator (see the error on that rank); no rank keeps one");
  return child;
}

void Comm::abort_transports() {
  if (!broken_reason_.empty()) return;  // already retired once
  for (auto& transport : transports_) transport->abort();
}

void Comm::retire(const char* op) {
  try {
    throw;
  } catch (const Failure& e) {
    abort_transports();
    const std::string message = std::strncmp(e.what(), op, std::strlen(op)) == 0 ? e.what() : cat(op, ": ", e.what());
    mark_broken(message);
    throw Failure(e.status(), message);
  } catch (const std::exception& e) {
    abort_transports();
    mark_broken(cat(op, ": ", e.what()));
    throw;
  }
}

}  // namespace a2a
