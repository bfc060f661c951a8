// Counts one path of a communicator (its data or its control transport) into
// its Counters: a round per exchange or collective, a message per
// point-to-point send to another rank. Comm puts one around each of its two
// transports, so that the same MPI transport serving both roles is counted by
// role; everything else is forwarded unchanged.
#pragma once

#include "core/counters.hpp"
#include "core/transport.hpp"

namespace a2a {

class CountingTransport final : public Transport {
 public:
  enum class Path { kData, kControl };
  CountingTransport(Transport& inner, Counters& counters, Path path);

  Transport& inner() { return inner_; }
  const char* name() const override { return inner_.name(); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  bool supports_strided() const override { return inner_.supports_strided(); }
  void set_stream(void* stream) override { inner_.set_stream(stream); }
  bool supports_capture() const override { return inner_.supports_capture(); }
  void check_async_error() override { inner_.check_async_error(); }
  void abort() override { inner_.abort(); }

  void group_start() override;
  void send(const Span& span, int peer) override;
  void recv(const Span& span, int peer) override { inner_.recv(span, peer); }
  void group_end() override;
  void cancel_group() override { inner_.cancel_group(); }

  bool supports_signed_exchange() const override { return inner_.supports_signed_exchange(); }
  bool supports_labelled_check() const override { return inner_.supports_labelled_check(); }
  bool signed_exchange(const PeerGroup& group, uint32_t label, size_t pieces,
                       const std::function<Span(int, size_t)>& send_piece,
                       const std::function<Span(int, size_t)>& recv_piece, int* disagreeing) override;
  std::vector<int64_t> signed_start(uint32_t label, const std::function<Span(int)>& send_span) override;
  void signed_finish(const std::function<Span(int)>& recv_span) override { inner_.signed_finish(recv_span); }
  void settle_disagreement() override;
  void post_check(const PeerGroup& group, uint32_t label) override;
  bool complete_check(int* disagreeing) override { return inner_.complete_check(disagreeing); }

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override;
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override;
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override;
  void barrier() override;

 private:
  void round(int64_t messages);
  Transport& inner_;
  Counters& counters_;
  Count rounds_, messages_;
  int64_t group_messages_ = 0;  // sends to other ranks in the open group
};

}  // namespace a2a
