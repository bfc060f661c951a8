// Validated entry points of the collectives: argument checks, the cross-rank
// agreement, then the algorithm. The C ABI (c_api.cpp) is a thin shell over
// these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/algorithms.hpp"
#include "core/comm.hpp"

namespace a2a {

size_t all_to_all_workspace_size(const Comm& comm, size_t count, a2a_dtype_t dtype, a2a_algo_t algo);
void all_to_all(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_algo_t algo,
                void* workspace, size_t workspace_bytes);

size_t all_to_all_flex_workspace_size(const Comm& comm, const int64_t* shape, int ndim, int split_axis,
                                      int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo);
void all_to_all_flex(Comm& comm, const void* send, void* recv, const int64_t* shape, int ndim, int split_axis,
                     int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo, void* workspace,
                     size_t workspace_bytes);

void all_gather(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype);
void all_reduce(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t op);
void reduce_scatter(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t op);
// Uneven forms: counts (host, size entries, equal on every rank) in elements;
// rank i's block holds counts[i] of them.
void all_gather_v(Comm& comm, const void* send, void* recv, const int64_t* counts, a2a_dtype_t dtype);
void reduce_scatter_v(Comm& comm, const void* send, void* recv, const int64_t* counts, a2a_dtype_t dtype,
                      a2a_reduce_op_t op);

class VPlan {
 public:
  // Collective: exchanges the counts (in rows of row_elements elements). `op`
  // names the call in errors and in the cross-rank check.
  VPlan(Comm& comm, const int64_t* send_counts, size_t row_elements, a2a_dtype_t dtype, a2a_algo_t algo,
        const char* op = "all_to_all_v (count exchange)");
  const std::vector<int64_t>& recv_counts() const { return recv_counts_; }  // rows
  size_t workspace_bytes() const { return workspace_bytes_; }
  void execute(const void* send, void* recv, void* workspace, size_t workspace_bytes);
  bool comm_exists() const { return !comm_lifetime_.expired(); }

 private:
  Comm& comm_;
  std::weak_ptr<const void> comm_lifetime_;  // expired once comm_ is destroyed
  a2a_dtype_t dtype_;
  a2a_algo_t algo_;
  VCounts bytes_;
  std::vector<int64_t> recv_counts_;
  size_t workspace_bytes_ = 0;
  // The comm's sequence number at planning, equal on every rank: execute()
  // checks that all ranks run the same plan.
  int64_t id_ = 0;
};

// One uneven all-to-all with counts known only to the senders, in two
// halves: the constructor (collective) sends the rows and learns how many
// arrive from each rank; finish() receives them. Linear over a transport
// that labels and probes messages (MPI), the counts travel as the sizes of
// the data messages themselves: one round. Otherwise (2DH, NCCL) the
// constructor exchanges the counts (a VPlan) and finish() moves the data.
// Until finish() (or the destructor, which drops the rows), every other call
// on the comm fails.
class VExchange {
 public:
  VExchange(Comm& comm, const void* send, const int64_t* send_counts, size_t row_elements, a2a_dtype_t dtype,
            a2a_algo_t algo);
  ~VExchange();
  VExchange(const VExchange&) = delete;
  VExchange& operator=(const VExchange&) = delete;
  const std::vector<int64_t>& recv_counts() const { return recv_counts_; }  // rows
  size_t workspace_bytes() const { return plan_ ? plan_->workspace_bytes() : 0; }
  bool comm_exists() const { return !comm_lifetime_.expired(); }
  // recv holds sum(recv_counts) rows. Once only.
  void finish(void* recv, void* workspace, size_t workspace_bytes);
  // Completes the exchange without keeping the rows (the destructor's): the
  // other ranks complete normally. Once only; finish() cannot follow.
  void drop();

 private:
  Comm& comm_;
  std::weak_ptr<const void> comm_lifetime_;
  const void* send_;
  size_t send_bytes_ = 0;
  std::unique_ptr<VPlan> plan_;  // the counts by round
  std::vector<int64_t> recv_counts_;
  size_t row_bytes_ = 0;
  bool open_ = false;  // one round: started, not yet finished
  bool finished_ = false;
};

// Fails every rank of `op` with A2A_ERROR_REMOTE, and this rank with
// A2A_ERROR_INVALID_ARGUMENT carrying `message`.
[[noreturn]] void report_invalid(Comm& comm, const char* op, const std::string& message);

}  // namespace a2a
