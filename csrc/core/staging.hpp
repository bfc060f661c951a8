// Two transports that carry one kind of memory over a transport made for the
// other, through a staging buffer:
//
//   StagedTransport         device buffers over a host transport (MPI): the
//                           `transport="mpi", device="cuda"` communicator.
//   DeviceControlTransport  host messages over a device transport (NCCL): the
//                           argument check and count exchange of a
//                           communicator made from a NCCL unique id alone.
//
// Both are written against Device, so the CPU tests run them too (with host
// copies for the staging: setup/testing_comm.hpp).
#pragma once

#include <vector>

#include "core/device.hpp"
#include "core/transport.hpp"

namespace a2a {

// One message of a point-to-point group, as posted.
struct PostedMessage {
  void* data;
  size_t bytes;
  int peer;
};

// The messages of one point-to-point group, and their places in a staging
// buffer laid out [all sends | all receives], in posting order.
class StagedGroup {
 public:
  void clear();
  void add_send(const Span& span, int peer, const char* transport);
  void add_recv(const Span& span, int peer, const char* transport);
  // Takes the first send to `me` and the first receive from `me` out of the
  // group (the exchange posts one of each); false when there is none.
  bool take_self_pair(int me, PostedMessage* send, PostedMessage* recv);
  size_t bytes() const;
  size_t send_bytes() const;
  // fn(message, its place in staging) for every send / every receive.
  template <typename Fn>
  void each_send(char* staging, Fn&& fn) const {
    size_t offset = 0;
    for (const auto& m : sends_) {
      fn(m, staging + offset);
      offset += m.bytes;
    }
  }
  template <typename Fn>
  void each_recv(char* staging, Fn&& fn) const {
    size_t offset = send_bytes();
    for (const auto& m : recvs_) {
      fn(m, staging + offset);
      offset += m.bytes;
    }
  }
  // The group on `transport` between the staging places, receives first as
  // exchange() posts them.
  void exchange(Transport& transport, char* staging) const;

 private:
  std::vector<PostedMessage> sends_, recvs_;
};

// Device memory over a host transport. A group:
//   1. copies every send device -> page-locked staging, on the stream;
//   2. waits for the stream (the sends' data, and anything before, is ready);
//   3. runs the group on the host transport between staging buffers;
//   4. copies every receive staging -> device, on the stream, and returns.
// Step 4 is still in flight on return; the next group's step 2 waits for it
// before the staging buffer is written again. Messages to oneself are a
// device copy. Waiting for the stream is a host synchronization, so this
// transport cannot run inside CUDA-graph capture (it says so).
class StagedTransport final : public Transport {
 public:
  StagedTransport(Transport& host, Device& device, double timeout_s);
  const char* name() const override { return "mpi-staged"; }
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  bool supports_strided() const override { return false; }
  bool supports_capture() const override { return false; }

  void group_start() override;
  void send(const Span& span, int peer) override;
  void recv(const Span& span, int peer) override;
  void group_end() override;
  void cancel_group() override { group_.clear(); }

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override;
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override;
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override;
  void barrier() override;

 private:
  void require_not_capturing(const char* what) const;
  template <typename Op>
  void staged(const char* what, const void* send, size_t in, void* recv, size_t out, Op&& op);
  Transport& host_;
  Device& device_;
  double timeout_s_;
  DeviceBuffer staging_;
  StagedGroup group_;
};

// Host memory over a stream-ordered device transport: every call copies the
// host bytes into a small device buffer, runs the device transport on the
// stream, copies back and waits for the stream (polling the transport's
// asynchronous errors, bounded by the timeout). The copies go through a
// page-locked bounce buffer: a device-to-pageable copy would block the host
// until the NCCL kernel before it finished, unbounded if a peer never comes.
class DeviceControlTransport final : public Transport {
 public:
  DeviceControlTransport(Transport& device_transport, Device& device, double timeout_s);
  const char* name() const override { return "control-over-device"; }
  int rank() const override { return data_.rank(); }
  int size() const override { return data_.size(); }
  bool supports_strided() const override { return false; }

  void group_start() override;
  void send(const Span& span, int peer) override;
  void recv(const Span& span, int peer) override;
  void group_end() override;
  void cancel_group() override { group_.clear(); }

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override;
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override;
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override;
  void barrier() override;

 private:
  void wait(const char* what);
  void require_not_capturing(const char* what) const;
  template <typename Op>
  void bounced(const char* what, const void* send, size_t in, void* recv, size_t out, Op&& op);
  Transport& data_;
  Device& device_;
  double timeout_s_;
  DeviceBuffer scratch_;  // device
  DeviceBuffer bounce_;   // page-locked host, laid out as scratch_
  StagedGroup group_;
};

}  // namespace a2a
