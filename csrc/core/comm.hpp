// A communicator: Transport + Device + Topology, plus the cross-rank argument
// check that every collective runs before it moves data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.hpp"
#include "core/topology.hpp"
#include "core/transport.hpp"

namespace a2a {

// One argument that must be equal on every rank, e.g. {"count", 1024}.
struct Field {
  const char* name;
  int64_t value;
};

class Comm {
 public:
  Comm(std::unique_ptr<Transport> transport, std::unique_ptr<Device> device, Topology topology,
       bool use_strided_spans);

  Transport& transport() { return *transport_; }
  Device& device() { return *device_; }
  const Topology& topology() const { return topology_; }
  int rank() const { return topology_.rank; }
  int size() const { return topology_.size; }
  // Strided spans go straight to the transport (e.g. MPI derived datatypes)
  // instead of being packed by the Device.
  bool strided_spans() const { return use_strided_spans_; }

  // Collective. Verifies that every rank called `op` with the same fields, and
  // that no rank rejected its input (local_error non-empty). On any
  // disagreement every rank throws: the rank with the bad input
  // A2A_ERROR_INVALID_ARGUMENT with local_error, the others
  // A2A_ERROR_REMOTE / A2A_ERROR_MISMATCH naming the ranks and values.
  //
  // The check overlaps the data exchange: agree() only starts it, and the
  // verdict is taken at the first wait inside run(). With a local_error it
  // completes (and throws) at once.
  void agree(const char* op, const std::vector<Field>& fields, const std::string& local_error = "");

  // Runs a collective's algorithm after agree(). A failed check abandons the
  // exchange and renews the transport (every rank reaches the same verdict),
  // so the comm stays usable; a transport failure (e.g. a timeout) retires it.
  template <typename Fn>
  void run(const char* op, Fn&& algorithm) {
    try {
      algorithm();
      transport_->finish_agreement();
    } catch (...) {
      recover(op);
      throw;
    }
  }

  // Called by the collectives after a transport failure (e.g. a timeout):
  // unmatched messages may be in flight, so the comm refuses further use.
  void mark_broken(const std::string& why);
  // How many collectives agree() has started: every rank calls agree() once
  // per collective (rejected ones included), so it is equal across ranks.
  int64_t sequence() const { return sequence_; }
  void check_usable(const char* op) const;

 private:
  // Evaluates the reduced agreement vector; throws on any disagreement.
  void judge();
  // Called with an exception in flight: resets the transport after a failed
  // check, retires the comm after anything else, then rethrows with op's name.
  [[noreturn]] void recover(const char* op);

  struct Agreement {
    const char* op = "";
    std::vector<Field> fields;
    std::string local_error;
    std::vector<int64_t> values;
    bool failed = false;
  };

  Agreement agreement_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Device> device_;
  Topology topology_;
  bool use_strided_spans_;
  std::string broken_reason_;
  int64_t sequence_ = 0;
};

}  // namespace a2a
