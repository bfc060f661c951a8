#include "core/counting_transport.hpp"

namespace a2a {

namespace {

constexpr int64_t kCollective = -1;  // round(): a collective of the transport, whose messages are its own

}  // namespace

CountingTransport::CountingTransport(Transport& inner, Counters& counters, Path path)
    : inner_(inner),
      counters_(counters),
      rounds_(path == Path::kData ? Count::kDataRounds : Count::kControlRounds),
      messages_(path == Path::kData ? Count::kDataMessages : Count::kControlMessages) {}

// A round is a wait on other ranks: a group that sends to none (a 1-rank
// communicator, every message empty) is a local copy; a transport's own
// collective (messages < 0: not counted) is a round wherever there are peers.
void CountingTransport::round(int64_t messages) {
  if (messages == 0 || size() == 1) return;
  count(&counters_, rounds_);
  if (messages > 0) count(&counters_, messages_, messages);
}

void CountingTransport::group_start() {
  group_messages_ = 0;
  inner_.group_start();
}

void CountingTransport::send(const Span& span, int peer) {
  // Zero-byte messages of a plain group are skipped by every transport.
  if (peer != rank() && span.bytes() != 0) ++group_messages_;
  inner_.send(span, peer);
}

void CountingTransport::group_end() {
  round(group_messages_);
  inner_.group_end();
}

bool CountingTransport::signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                                        const std::function<Span(int, size_t)>& send_piece,
                                        const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) {
  round(static_cast<int64_t>(group.count - 1) * static_cast<int64_t>(pieces));
  return inner_.signed_exchange(group, label, pieces, send_piece, recv_piece, disagreeing);
}

std::vector<int64_t> CountingTransport::signed_start(uint32_t label, const std::function<Span(int)>& send_span) {
  round(size() - 1);
  return inner_.signed_start(label, send_span);
}

// Posted, not waited for: its messages count, and no round (the host waits
// for them, if at all, at a later call, while they have long arrived).
void CountingTransport::post_check(const PeerGroup& group, uint32_t label) {
  if (size() > 1) count(&counters_, messages_, group.count - 1);
  inner_.post_check(group, label);
}

void CountingTransport::settle_disagreement() {
  round(size() - 1);  // the notices, then what the settle takes
  inner_.settle_disagreement();
}

void CountingTransport::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  round(size() - 1);
  inner_.allgather(send, recv, bytes_per_rank);
}

void CountingTransport::allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) {
  round(kCollective);
  inner_.allreduce(send, recv, count, dtype, op);
}

void CountingTransport::reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype,
                                       ReduceOp op) {
  round(kCollective);
  inner_.reduce_scatter(send, recv, count_per_rank, dtype, op);
}

void CountingTransport::allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) {
  round(size() - 1);
  inner_.allgather_v(send, recv, bytes_per_rank);
}

void CountingTransport::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts,
                                         a2a_dtype_t dtype, ReduceOp op) {
  round(kCollective);
  inner_.reduce_scatter_v(send, recv, counts, dtype, op);
}

void CountingTransport::barrier() {
  round(kCollective);
  inner_.barrier();
}

}  // namespace a2a
