#include "core/staging.hpp"

#include <algorithm>
#include <cstring>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace a2a {

namespace {

PostedMessage posted(const Span& span, int peer, const char* transport, const char* kind) {
  if (!span.is_contiguous())
    fail(A2A_ERROR_INTERNAL, transport, ": ", kind, " of a strided span (the algorithms pack layouts for it)");
  return PostedMessage{span.data, span.bytes(), peer};
}

size_t total_bytes(const std::vector<PostedMessage>& messages) {
  size_t total = 0;
  for (const auto& m : messages) total += m.bytes;
  return total;
}

size_t sum(const std::vector<size_t>& values) {
  size_t total = 0;
  for (size_t v : values) total += v;
  return total;
}

}  // namespace

// ---------------------------------------------------------------------------
// StagedGroup

void StagedGroup::clear() {
  sends_.clear();
  recvs_.clear();
}

void StagedGroup::add_send(const Span& span, int peer, const char* transport) {
  sends_.push_back(posted(span, peer, transport, "send"));
}

void StagedGroup::add_recv(const Span& span, int peer, const char* transport) {
  recvs_.push_back(posted(span, peer, transport, "recv"));
}

bool StagedGroup::take_self_pair(int me, PostedMessage* send, PostedMessage* recv) {
  auto is_me = [me](const PostedMessage& m) { return m.peer == me; };
  auto s = std::find_if(sends_.begin(), sends_.end(), is_me);
  auto r = std::find_if(recvs_.begin(), recvs_.end(), is_me);
  if (s == sends_.end() || r == recvs_.end()) return false;
  *send = *s;
  *recv = *r;
  sends_.erase(s);
  recvs_.erase(r);
  return true;
}

size_t StagedGroup::send_bytes() const { return total_bytes(sends_); }
size_t StagedGroup::bytes() const { return send_bytes() + total_bytes(recvs_); }

void StagedGroup::exchange(Transport& transport, char* staging) const {
  transport.group_start();
  each_recv(staging, [&](const PostedMessage& m, char* place) { transport.recv(Span::contiguous(place, m.bytes), m.peer); });
  each_send(staging, [&](const PostedMessage& m, char* place) { transport.send(Span::contiguous(place, m.bytes), m.peer); });
  transport.group_end();
}

// ---------------------------------------------------------------------------
// StagedTransport

StagedTransport::StagedTransport(Transport& host, Device& device, double timeout_s)
    : host_(host), device_(device), timeout_s_(timeout_s), staging_(device, DeviceBuffer::Kind::kHost) {}

void StagedTransport::require_not_capturing(const char* what) const {
  if (device_.capturing())
    fail(A2A_ERROR_UNSUPPORTED, what, " on rank ", rank(), ": the staged MPI transport waits for the stream, which "
         "cannot happen while it is being captured into a CUDA graph; capture with a NCCL communicator instead");
}

void StagedTransport::group_start() { group_.clear(); }
void StagedTransport::send(const Span& span, int peer) { group_.add_send(span, peer, name()); }
void StagedTransport::recv(const Span& span, int peer) { group_.add_recv(span, peer, name()); }

void StagedTransport::group_end() {
  require_not_capturing("a staged exchange");
  PostedMessage self_send{}, self_recv{};
  if (group_.take_self_pair(rank(), &self_send, &self_recv)) {
    if (self_send.bytes != self_recv.bytes)
      fail(A2A_ERROR_INTERNAL, name(), ": rank ", rank(), " sends ", self_send.bytes, " bytes to itself but expects ",
           self_recv.bytes);
    device_.copy(self_recv.data, self_send.data, self_send.bytes);
  }
  char* staging = staging_.reserve(group_.bytes(), timeout_s_);
  // 1. device -> staging
  group_.each_send(staging, [&](const PostedMessage& m, char* place) { device_.copy_to_host(place, m.data, m.bytes); });
  // 2. the sends' bytes are on the host, and the previous group's receives
  //    have left the staging buffer.
  device_.synchronize(timeout_s_);
  // 3. the exchange between staging places
  group_.exchange(host_, staging);
  // 4. staging -> device, left in flight
  group_.each_recv(staging, [&](const PostedMessage& m, char* place) { device_.copy_from_host(m.data, place, m.bytes); });
  group_.clear();
}

// The dense collectives: `in` bytes of send staged to the host, `op` between
// the staging places [in | out], `out` bytes back to recv (left in flight).
template <typename Op>
void StagedTransport::staged(const char* what, const void* send, size_t in, void* recv, size_t out, Op&& op) {
  require_not_capturing(what);
  char* staging = staging_.reserve(in + out, timeout_s_);
  device_.copy_to_host(staging, send, in);
  device_.synchronize(timeout_s_);
  op(staging, staging + in);
  device_.copy_from_host(recv, staging + in, out);
}

void StagedTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  staged("a staged allgather", send, bytes_per_rank, recv, bytes_per_rank * size(),
         [&](char* in, char* out) { host_.allgather(in, out, bytes_per_rank); });
}

void StagedTransport::allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  staged("a staged allreduce", send, bytes, recv, bytes,
         [&](char* in, char* out) { host_.allreduce(in, out, count, dtype, op); });
}

void StagedTransport::reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                                     ReduceOp op) {
  const size_t block = count_per_rank * dtype_size(dtype);
  staged("a staged reduce_scatter", send, block * size(), recv, block,
         [&](char* in, char* out) { host_.reduce_scatter(in, out, count_per_rank, dtype, op); });
}

void StagedTransport::allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) {
  staged("a staged allgather_v", send, bytes_per_rank[rank()], recv, sum(bytes_per_rank),
         [&](char* in, char* out) { host_.allgather_v(in, out, bytes_per_rank); });
}

void StagedTransport::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts,
                                       a2a_dtype_t dtype, ReduceOp op) {
  const size_t item = dtype_size(dtype);
  staged("a staged reduce_scatter_v", send, sum(counts) * item, recv, counts[rank()] * item,
         [&](char* in, char* out) { host_.reduce_scatter_v(in, out, counts, dtype, op); });
}

void StagedTransport::barrier() {
  require_not_capturing("a staged barrier");
  device_.synchronize(timeout_s_);
  host_.barrier();
}

// ---------------------------------------------------------------------------
// DeviceControlTransport

DeviceControlTransport::DeviceControlTransport(Transport& device_transport, Device& device, double timeout_s)
    : data_(device_transport),
      device_(device),
      timeout_s_(timeout_s),
      scratch_(device, DeviceBuffer::Kind::kDevice),
      bounce_(device, DeviceBuffer::Kind::kHost) {}

void DeviceControlTransport::require_not_capturing(const char* what) const {
  if (device_.capturing())
    fail(A2A_ERROR_UNSUPPORTED, what, " on rank ", rank(), ": a communicator made from a NCCL unique id exchanges "
         "host values (all-to-all-v counts, the MoE capacity) by waiting for the stream, which cannot happen while "
         "it is being captured into a CUDA graph; do this outside the capture (e.g. plan all-to-all-v first)");
}

void DeviceControlTransport::wait(const char* what) {
  try {
    device_.synchronize(timeout_s_, [this] { data_.check_async_error(); });
  } catch (const Failure& e) {
    if (e.status() != A2A_ERROR_TIMEOUT) throw;
    fail(A2A_ERROR_TIMEOUT, "rank ", rank(), " of ", size(), ": timed out after ", timeout_s_, " s in ", what,
         " over ", data_.name(), ": another rank did not make the same call (it may have failed, be stuck, or be "
         "calling a different collective); raise A2A_TIMEOUT_S if it is only slow");
  }
}

void DeviceControlTransport::group_start() { group_.clear(); }
void DeviceControlTransport::send(const Span& span, int peer) { group_.add_send(span, peer, name()); }
void DeviceControlTransport::recv(const Span& span, int peer) { group_.add_recv(span, peer, name()); }

void DeviceControlTransport::group_end() {
  require_not_capturing("a control exchange");
  const size_t bytes = group_.bytes(), sent = group_.send_bytes();
  char* scratch = scratch_.reserve(bytes, timeout_s_);
  char* bounce = bounce_.reserve(bytes, timeout_s_);
  group_.each_send(bounce, [](const PostedMessage& m, char* place) { std::memcpy(place, m.data, m.bytes); });
  device_.copy_from_host(scratch, bounce, sent);
  group_.exchange(data_, scratch);
  device_.copy_to_host(bounce + sent, scratch + sent, bytes - sent);
  wait("a control exchange");
  group_.each_recv(bounce, [](const PostedMessage& m, char* place) { std::memcpy(m.data, place, m.bytes); });
  group_.clear();
}

// The dense collectives on host values: `in` bytes of send through the
// page-locked bounce buffer to the device, `op` between the device places
// [in | out], `out` bytes back the same way, after waiting for the stream.
template <typename Op>
void DeviceControlTransport::bounced(const char* what, const void* send, size_t in, void* recv, size_t out, Op&& op) {
  require_not_capturing(what);
  char* scratch = scratch_.reserve(in + out, timeout_s_);
  char* bounce = bounce_.reserve(in + out, timeout_s_);
  std::memcpy(bounce, send, in);
  device_.copy_from_host(scratch, bounce, in);
  op(scratch, scratch + in);
  device_.copy_to_host(bounce + in, scratch + in, out);
  wait(what);
  std::memcpy(recv, bounce + in, out);
}

void DeviceControlTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  bounced("the argument check (allgather)", send, bytes_per_rank, recv, bytes_per_rank * size(),
          [&](char* in, char* out) { data_.allgather(in, out, bytes_per_rank); });
}

void DeviceControlTransport::allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  bounced("an allreduce of host values", send, bytes, recv, bytes,
          [&](char* in, char* out) { data_.allreduce(in, out, count, dtype, op); });
}

void DeviceControlTransport::reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                                            ReduceOp op) {
  const size_t block = count_per_rank * dtype_size(dtype);
  bounced("a reduce_scatter of host values", send, block * size(), recv, block,
          [&](char* in, char* out) { data_.reduce_scatter(in, out, count_per_rank, dtype, op); });
}

void DeviceControlTransport::allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) {
  bounced("an allgather_v of host values", send, bytes_per_rank[rank()], recv, sum(bytes_per_rank),
          [&](char* in, char* out) { data_.allgather_v(in, out, bytes_per_rank); });
}

void DeviceControlTransport::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts,
                                              a2a_dtype_t dtype, ReduceOp op) {
  const size_t item = dtype_size(dtype);
  bounced("a reduce_scatter_v of host values", send, sum(counts) * item, recv, counts[rank()] * item,
          [&](char* in, char* out) { data_.reduce_scatter_v(in, out, counts, dtype, op); });
}

void DeviceControlTransport::barrier() {
  int64_t token = 0;
  allreduce_int64(&token, 1, ReduceOp::kSum);
}

}  // namespace a2a
