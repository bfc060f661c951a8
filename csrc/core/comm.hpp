// A communicator: Transport + Device + Topology, plus the cross-rank argument
// check that every collective runs before it moves data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "a2a/a2a.h"
#include "core/call_guard.hpp"
#include "core/call_predictor.hpp"
#include "core/counters.hpp"
#include "core/counting_transport.hpp"
#include "core/device.hpp"
#include "core/error.hpp"
#include "core/topology.hpp"
#include "core/transport.hpp"

namespace a2a {

// One argument that must be equal on every rank, e.g. {"count", 1024}.
// Errors print "dtype", "algo", "reduce_op" and "capacity_setting" (a float64
// given as its bits) by meaning, the rest as integers.
struct Field {
  const char* name;
  int64_t value;
  // The value is a call's sequence number (a plan's): the predicted check
  // (CallPredictor) knows the call just before as such, so that a one-shot
  // plan's repeats.
  bool is_call = false;
};

class Comm;

// The cross-rank check of one call where it travels in the call's own
// messages (Comm::begin_in_band): the call's signature, and how many of its
// exchanges have carried it (each has a label of its own).
struct InBandCheck {
  const char* op;
  std::vector<Field> fields;
  uint64_t signature = 0;  // a digest of (op, fields, sequence)
  int exchanges = 0;
};

// The backend half of Comm::split, which setup/ gives every communicator it
// builds: it knows how that communicator was made (its MPI or NCCL
// communicator, settings, arrangement of transports) and makes new ones alike.
class Splitter {
 public:
  virtual ~Splitter() = default;
  // Collective over every rank of `parent` (color A2A_UNDEFINED included):
  // splits the backends' communicators and returns this rank's new one with
  // `topology`, or nullptr for A2A_UNDEFINED. The backends order the ranks of
  // a color by topology.rank, so that theirs match it. Must make the same
  // collective calls on every rank until they are all made: a local failure
  // (e.g. building the device) comes after them.
  virtual std::unique_ptr<Comm> split(Comm& parent, int color, const Topology& topology) = 0;
};

// What a communicator is built from. `data` moves the collectives' buffers
// (memory of `device`); `control` moves small host messages (the argument
// check, all-to-all-v counts, the MoE capacity). They are one MPI transport on
// the CPU; MPI under NCCL or a staged transport; or, for a communicator made
// from a NCCL unique id alone, NCCL itself through a device buffer
// (control_waits_for_stream: each control message waits for the stream).
struct CommParts {
  std::unique_ptr<Device> device;
  // Owned transports, in construction order; a later one may wrap an
  // earlier one, so they are destroyed last to first.
  std::vector<std::unique_ptr<Transport>> transports;
  Transport* data = nullptr;
  Transport* control = nullptr;
  bool control_waits_for_stream = false;
  int device_type = A2A_DEVICE_CPU;     // a2a_device_type_t
  int transport = A2A_TRANSPORT_MPI;    // a2a_transport_t
  // How to make sub-communicators of this kind; none: Comm::split fails
  // with A2A_ERROR_UNSUPPORTED.
  std::unique_ptr<Splitter> splitter;
  // Every collective checks that all ranks called it alike (a2a_comm_config_t.cross_check).
  bool cross_check = true;
  // The data transport returns before the data moved (NCCL): the check of a
  // call that every rank predicted is posted on the control transport and
  // completed at the next call (Comm::agree, docs/algorithms.md "The
  // predicted check"). Needs a control transport that labels messages.
  bool predicts_check = false;
};

// The argument check's verdict (Comm::agree): every rank throws one, nothing
// is left in flight, and the comm stays usable, so Comm::run passes it
// through instead of retiring the comm.
class Disagreement : public Failure {
 public:
  using Failure::Failure;
};

// The verdict that one field of the signature differs across ranks (every
// rank throws it for the same field), so that a collective may explain that
// field further (the uneven dense collectives name the entry of the counts
// whose digest differs).
class FieldDisagreement : public Disagreement {
 public:
  FieldDisagreement(a2a_status_t status, const std::string& message, const char* field)
      : Disagreement(status, message), field_(field) {}
  const char* field() const { return field_; }

 private:
  const char* field_;
};

class Comm {
 public:
  Comm(std::unique_ptr<Transport> transport, std::unique_ptr<Device> device, Topology topology,
       bool use_strided_spans);
  Comm(CommParts parts, Topology topology, bool use_strided_spans);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  Transport& transport() { return *data_; }
  Transport& control() { return *control_; }
  int device_type() const { return device_type_; }
  int transport_kind() const { return transport_kind_; }
  // The stream of the following calls (CUDA communicators).
  void set_stream(void* stream);
  // Fails with A2A_ERROR_UNSUPPORTED, before anything is enqueued, when the
  // control transport would have to wait for a stream that is being captured
  // into a CUDA graph (a communicator made from a NCCL unique id).
  void require_control_outside_capture(const char* op) const;
  Device& device() { return *device_; }
  const Topology& topology() const { return topology_; }
  int rank() const { return topology_.rank; }
  int size() const { return topology_.size; }
  // Strided spans go straight to the transport (e.g. MPI derived datatypes)
  // instead of being packed by the Device.
  bool strided_spans() const { return use_strided_spans_; }

  // Collective. Verifies that every rank called `op` with the same fields, and
  // that no rank rejected its input (local_error non-empty), before any data
  // moves. On any disagreement every rank throws: the rank with the bad input
  // A2A_ERROR_INVALID_ARGUMENT with local_error, the others
  // A2A_ERROR_REMOTE / A2A_ERROR_MISMATCH naming the ranks and values. The
  // comm stays usable afterwards. On a comm that checks in band this is a
  // round of empty labelled messages, for the calls whose own messages cannot
  // carry the check (begin_in_band is the way for those that can). On a comm
  // that predicts (predicts_check()) it first completes the last call's
  // posted check; then a call that every rank predicted posts its own and
  // returns at once, and any other checks by a labelled round.
  void agree(const char* op, const std::vector<Field>& fields, const std::string& local_error = "");

  // Where the check travels in the call's own messages (checks_in_band()
  // and cross_checks(), and this rank's input valid): counts the call, like
  // agree(), and returns its check, which every exchange of the call then
  // carries (exchange_in_band). The call's exchanges must, together, connect
  // every rank to every other through agreeing labels: one over the world,
  // or one inside each node followed by one along each rail (2DH), so that
  // no rank completes a call in which two ranks disagree.
  InBandCheck begin_in_band(const char* op, std::vector<Field> fields);
  // One exchange of such a call inside `group` over `transport` (the data or
  // the control transport), as exchange_pieces() runs it, every message
  // labelled with the check's signature and this exchange's index. Where any
  // rank's labels or sizes disagree, every rank settles the call's messages
  // (Transport::settle_disagreement) and throws agree()'s errors; the
  // receive spans may then hold what agreeing peers sent. A failure inside
  // the exchange retires the comm, as run() does.
  void exchange_in_band(InBandCheck& check, Transport& transport, const PeerGroup& group, size_t pieces,
                        const std::function<Span(int, size_t)>& send_piece,
                        const std::function<Span(int, size_t)>& recv_piece);
  // agree() and then one exchange over the world on `transport`, as one
  // round where the comm checks in band and this rank's input is valid (the
  // check carried by the exchange), else as agree() followed by the exchange.
  void agree_in_exchange(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                         Transport& transport, const std::function<Span(int)>& send_span,
                         const std::function<Span(int)>& recv_span);
  // The two halves of a first exchange whose receivers learn the sizes from
  // the messages (the uneven all-to-all in one round; needs checks_in_band()).
  // start_in_band checks that every rank called `op` with the same fields as
  // begin_in_band does, posts send_span(i) to every rank over the data
  // transport and returns the bytes each rank sent here, every one a
  // multiple of `unit`; on any disagreement it settles what arrived and
  // throws agree()'s errors on every rank. Until finish_in_band receives the
  // messages into recv_span(r) (or drop_in_band drops them), every other
  // call on this comm fails.
  std::vector<int64_t> start_in_band(const char* op, const std::vector<Field>& fields,
                                     const std::function<Span(int)>& send_span, size_t unit);
  void finish_in_band(const char* op, const std::function<Span(int)>& recv_span);
  void drop_in_band(const char* op);

  // True where the check travels in the collectives' own messages: one
  // transport for data and control, which can label messages (MPI).
  bool checks_in_band() const { return in_band_; }
  // True where a call that every rank predicted alike posts its check and
  // goes on (CommParts::predicts_check): the check completes at the next
  // call on this comm, or at check_posted().
  bool predicts_check() const { return predicts_; }
  // Completes the posted check of the last call, if any (bounded): where a
  // rank left the predicted call, every rank raises, and the comm is retired.
  void check_posted(const char* op);
  // False: collectives skip the cross-rank check (agree() checks this rank's input alone).
  bool cross_checks() const { return cross_check_; }

  // Collective (MPI_Comm_split semantics): the ranks that pass the same
  // color form a new communicator of this one's kind, ranked by (key, rank);
  // nullptr for color A2A_UNDEFINED. Its topology follows this one's nodes
  // (split_topology). A bad color or a failure on any rank throws on every
  // rank; a failure inside the backends' split (a timeout, an MPI or NCCL
  // error) also retires this comm, as run() does.
  std::unique_ptr<Comm> split(int color, int key);

  // Shared by everything that keeps a reference to this comm (a VPlan): it
  // expires when the comm is destroyed, so that a use after destruction is a
  // clear error instead of undefined behaviour.
  std::weak_ptr<const void> lifetime() const { return lifetime_; }

  // Runs a collective's algorithm after agree(). A failure inside it (a
  // timeout, an MPI error) can leave messages in flight, so it retires the
  // comm; the error is rethrown with op's name.
  template <typename Fn>
  void run(const char* op, Fn&& algorithm) {
    try {
      algorithm();
    } catch (const Disagreement&) {
      throw;
    } catch (const PostedCheckFailed& e) {
      explain_posted(op, e.member(), "while this call waited for its peers");
    } catch (...) {
      retire(op);
    }
  }

  // Called by the collectives after a transport failure (e.g. a timeout):
  // unmatched messages may be in flight, so the comm refuses further use.
  void mark_broken(const std::string& why);
  // How many collectives agree() has started: every rank calls agree() once
  // per collective (rejected ones included), so it is equal across ranks.
  int64_t sequence() const { return sequence_; }
  void check_usable(const char* op) const;

  // Guards the entry points against concurrent calls (core/call_guard.hpp);
  // creation records MPI's thread support in it.
  CallGate& call_gate() { return call_gate_; }

  // Host memory for one call's temporaries (the blocks a reduction receives,
  // core/reduce_exchanges.cpp, on CPU communicators): at least `bytes`, a
  // DeviceBuffer kept and grown as needed, valid until the next call on this
  // comm asks for it.
  char* host_scratch(size_t bytes);

  // What this communicator's calls cost (core/counters.hpp): its two paths
  // are counted by the CountingTransports around them, its device by itself.
  Counters& counters() { return counters_; }

 private:
  // The last call, while its check is posted and not yet completed.
  struct PostedCall {
    std::string op;
    std::vector<Field> fields;
    int64_t sequence = 0;
    bool open = false;
    std::string found;  // where its disagreement was found, for the error
  };
  // Called with an exception in flight: marks the comm broken and rethrows
  // the error with op's name.
  [[noreturn]] void retire(const char* op);
  void abort_transports();
  // The round of empty labelled messages that agree() runs on an in-band
  // comm.
  void agree_in_band(const char* op, const std::vector<Field>& fields);
  // After a disagreement of the labels (or a rank's rejected input) on an
  // in-band comm, on every rank: settles the call's messages, then one
  // allgather of the signatures gives every rank the same detailed verdict.
  // data_moved: the labelled messages were the data, now in the outputs;
  // disagreeing_rank: whose message this rank found unlike its own, or -1.
  [[noreturn]] void settle_and_explain(const char* op, const std::vector<Field>& fields,
                                       const std::string& local_error, a2a_status_t local_status,
                                       int disagreeing_rank, bool data_moved);
  // One allgather of the signatures over the control transport and the
  // verdict, the same on every rank: returns only when every rank agrees and
  // none rejected its input (agree() by round, and after a settle).
  // posted: the call being explained is the posted check of an earlier one
  // (its sequence, and its data enqueued on this rank).
  void gather_verdict(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                      a2a_status_t local_status, bool data_moved, const PostedCall* posted = nullptr);
  // agree() where the comm predicts: posts the check of a predicted call, or
  // checks by a labelled round (agree_in_band on the control transport).
  void agree_predicted(const char* op, const std::vector<Field>& fields, const std::string& local_error,
                       a2a_status_t local_status);
  // After the posted check of the last call found a peer outside it (member
  // of the world, or -1) `when` (words for the error): settles, and raises
  // the verdict on every rank.
  [[noreturn]] void explain_posted(const char* op, int member, const std::string& when);

  Counters counters_;
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Transport>> transports_;
  // The data and control transports as the collectives see them: the
  // counting wrappers around the backends' (counted_data_, counted_control_).
  std::unique_ptr<CountingTransport> counted_data_, counted_control_;
  Transport* data_;
  Transport* control_;
  bool control_waits_for_stream_;
  int device_type_;
  int transport_kind_;
  Topology topology_;
  bool use_strided_spans_;
  bool in_band_;
  bool cross_check_;
  bool predicts_;
  CallPredictor predictor_;
  PostedCall posted_;
  std::string started_op_;  // start_in_band's op until finish_in_band
  DeviceBuffer host_scratch_;
  std::shared_ptr<const void> lifetime_ = std::make_shared<char>(0);
  std::string broken_reason_;
  int64_t sequence_ = 0;
  CallGate call_gate_;
  std::unique_ptr<Splitter> splitter_;
};

}  // namespace a2a
