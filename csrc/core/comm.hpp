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
// Errors print "dtype", "algo" and "capacity_setting" (a float64 given as its
// bits) by meaning, the rest as integers.
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
  // that no rank rejected its input (local_error non-empty), before any data
  // moves. On any disagreement every rank throws: the rank with the bad input
  // A2A_ERROR_INVALID_ARGUMENT with local_error, the others
  // A2A_ERROR_REMOTE / A2A_ERROR_MISMATCH naming the ranks and values. The
  // comm stays usable afterwards.
  void agree(const char* op, const std::vector<Field>& fields, const std::string& local_error = "");

  // Runs a collective's algorithm after agree(). A failure inside it (a
  // timeout, an MPI error) can leave messages in flight, so it retires the
  // comm; the error is rethrown with op's name.
  template <typename Fn>
  void run(const char* op, Fn&& algorithm) {
    try {
      algorithm();
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

 private:
  // Called with an exception in flight: marks the comm broken and rethrows
  // the error with op's name.
  [[noreturn]] void retire(const char* op);

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Device> device_;
  Topology topology_;
  bool use_strided_spans_;
  std::string broken_reason_;
  int64_t sequence_ = 0;
};

}  // namespace a2a
