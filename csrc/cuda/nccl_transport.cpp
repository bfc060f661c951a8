// Transport over NCCL: grouped ncclSend/ncclRecv and the dense collectives,
// enqueued on the stream of the call (set_stream). One ncclComm_t per
// transport, so every a2a communicator, sub-groups included, has its own.
//
// The communicator is non-blocking (ncclConfig_t.blocking = 0): NCCL calls
// return ncclInProgress instead of blocking the host while peers connect, and
// settle() polls ncclCommGetAsyncError with the communicator's timeout. So a
// missing peer turns into A2A_ERROR_TIMEOUT (and ncclCommAbort) rather than
// a hang, also during creation and the first exchange with each peer.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "core/debug.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/poll.hpp"
#include "cuda/cuda_check.hpp"
#include "setup/backends.hpp"

namespace a2a {

namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "ncclUniqueId changed size");

ncclDataType_t nccl_type(a2a_dtype_t dtype) {
  switch (dtype) {
    case A2A_FLOAT32: return ncclFloat32;
    case A2A_FLOAT64: return ncclFloat64;
    case A2A_FLOAT16: return ncclFloat16;
    case A2A_BFLOAT16: return ncclBfloat16;
    case A2A_INT8: return ncclInt8;
    case A2A_INT32: return ncclInt32;
    case A2A_INT64: return ncclInt64;
    case A2A_UINT8: return ncclUint8;
  }
  fail(A2A_ERROR_INTERNAL, "nccl: no NCCL type for dtype code ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(const void* id, int size, int rank, int cuda_device, double timeout_s)
      : rank_(rank), size_(size), device_(cuda_device), timeout_s_(timeout_s) {
    if (size < 1 || rank < 0 || rank >= size)
      fail(A2A_ERROR_INVALID_ARGUMENT, "NCCL communicator: rank ", rank, " is not in [0, ", size, ")");
    ncclUniqueId unique_id;
    std::memcpy(&unique_id, id, sizeof unique_id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const CurrentDevice current(device_);
    const ncclResult_t result = ncclCommInitRankConfig(&comm_, size, unique_id, rank, &config);
    if (result != ncclSuccess && result != ncclInProgress) {
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);  // a non-blocking init may have made one
      comm_ = nullptr;
      fail(A2A_ERROR_TRANSPORT, "rank ", rank, " of ", size, ": ncclCommInitRankConfig failed: ",
           ncclGetErrorString(result), "; ", ncclGetLastError(nullptr));
    }
    try {
      settle(result, "creating the NCCL communicator (ncclCommInitRankConfig)");
    } catch (...) {
      abort();
      throw;
    }
  }

  // Adopts `comm`, made by ncclCommSplit (split() below).
  NcclTransport(ncclComm_t comm, int rank, int size, int cuda_device, double timeout_s)
      : rank_(rank), size_(size), device_(cuda_device), timeout_s_(timeout_s), comm_(comm) {}

  ~NcclTransport() override {
    if (comm_ == nullptr || cuda_is_unloading()) return;  // at process exit the teardown frees it
    // Finalize flushes what is still enqueued; a peer that never comes must
    // not hang the destructor, so the wait is bounded and falls back to abort.
    try {
      const CurrentDevice current(device_);
      settle(ncclCommFinalize(comm_), "finalizing the NCCL communicator (ncclCommFinalize)");
      (void)ncclCommDestroy(comm_);
    } catch (const std::exception& e) {
      // A destructor cannot raise: say it on stderr whatever A2A_DEBUG is. The usual cause is a CUDA
      // graph that captured this communicator's calls and is still alive (NCCL's finalize waits for it).
      debug::detail::emit(debug::Level::kWarn,
                          cat(e.what(), "; the NCCL communicator is aborted instead. If a CUDA graph captured "
                              "its calls, destroy the graph before the communicator"));
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool supports_strided() const override { return false; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  void group_start() override {
    check_usable();
    call(ncclGroupStart(), "ncclGroupStart");
  }
  void send(const Span& span, int peer) override {
    require_contiguous(span, "send to", peer);
    call(ncclSend(span.data, span.bytes(), ncclUint8, peer, comm_, stream_), "ncclSend", peer);
  }
  void recv(const Span& span, int peer) override {
    require_contiguous(span, "recv from", peer);
    call(ncclRecv(span.data, span.bytes(), ncclUint8, peer, comm_, stream_), "ncclRecv", peer);
  }
  // NCCL's group depth is per thread: a group left open would swallow every
  // later NCCL call of this thread (creating a new communicator included).
  void cancel_group() override { (void)ncclGroupEnd(); }
  void group_end() override {
    const CurrentDevice current(device_);
    settle(ncclGroupEnd(), "ncclGroupEnd (the grouped sends and receives)");
  }

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override {
    check_usable();
    const CurrentDevice current(device_);
    settle(ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, stream_), "ncclAllGather");
  }
  void allreduce(const void* send, void* recv, size_t count, a2a_dtype_t dtype, ReduceOp op) override {
    check_usable();
    const CurrentDevice current(device_);
    settle(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, stream_), "ncclAllReduce");
  }
  void reduce_scatter(const void* send, void* recv, size_t count_per_rank, a2a_dtype_t dtype, ReduceOp op) override {
    check_usable();
    const CurrentDevice current(device_);
    settle(ncclReduceScatter(send, recv, count_per_rank, nccl_type(dtype), nccl_op(op), comm_, stream_),
           "ncclReduceScatter");
  }
  // NCCL has no uneven collectives. Both run as one group of rooted
  // collectives, one per non-empty block: allgather_v broadcasts block r
  // from rank r, reduce_scatter_v reduces block r onto rank r. Each rooted
  // collective is pipelined through every rank (ring or tree), so a rank's
  // traffic stays near the total size however skewed the counts are; grouped
  // ncclSend/ncclRecv would make the owner of a large block send it size - 1
  // times over its own links. Ranks skip the same empty blocks: the counts
  // are agreed before the call.
  void allgather_v(const void* send, void* recv, const std::vector<size_t>& bytes_per_rank) override {
    grouped("the grouped ncclBroadcast of allgather_v", [&] {
      size_t offset = 0;
      for (int root = 0; root < size_; ++root) {
        const size_t bytes = bytes_per_rank[root];
        if (bytes != 0)
          call(ncclBroadcast(send, static_cast<char*>(recv) + offset, bytes, ncclUint8, root, comm_, stream_),
               "ncclBroadcast", root);
        offset += bytes;
      }
    });
  }
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, a2a_dtype_t dtype,
                        ReduceOp op) override {
    const size_t item = dtype_size(dtype);
    grouped("the grouped ncclReduce of reduce_scatter_v", [&] {
      size_t offset = 0;
      for (int root = 0; root < size_; ++root) {
        // recvbuff is read on the root only (NCCL checks it there alone).
        if (counts[root] != 0)
          call(ncclReduce(static_cast<const char*>(send) + offset * item, recv, counts[root], nccl_type(dtype),
                          nccl_op(op), root, comm_, stream_),
               "ncclReduce", root);
        offset += counts[root];
      }
    });
  }
  // Stream-ordered: the barrier is reached when the stream gets there.
  // (DeviceControlTransport::barrier waits for it on the host.)
  void barrier() override {
    fail(A2A_ERROR_INTERNAL, "NcclTransport::barrier: use the control transport, which waits for the stream");
  }

  void check_async_error() override {
    if (comm_ == nullptr) return;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
    if (result != ncclSuccess) state = result;
    if (state != ncclSuccess && state != ncclInProgress) raise(state, "an asynchronous NCCL operation", -1);
  }

  void abort() override {
    if (comm_ == nullptr) return;
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // ncclCommSplit, non-blocking like every communicator here: NCCL reports
  // the split on the parent (in progress until it completes, then the new
  // handle is filled), and the new communicator's own setup on it. Both are
  // polled with the timeout. A failure aborts this communicator, whose state
  // is then unknown.
  std::unique_ptr<Transport> split(int color, int key) {
    check_usable();
    const CurrentDevice current(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const bool joins = color != A2A_UNDEFINED;
    const char* what = "splitting the NCCL communicator (ncclCommSplit)";
    // NCCL may write the handle after the call returns: on the heap, and left
    // there (not freed) if the wait fails.
    auto handle = std::make_unique<ncclComm_t>(nullptr);
    int rank = -1, size = 0;
    try {
      settle(ncclCommSplit(comm_, joins ? color : NCCL_SPLIT_NOCOLOR, key, handle.get(), &config), what);
      if (!joins) return nullptr;
      if (*handle == nullptr)
        fail(A2A_ERROR_INTERNAL, "rank ", rank_, " of ", size_, ": ncclCommSplit with color ", color,
             " made no communicator");
      settle_on(*handle, ncclSuccess, what);
      const ncclResult_t rank_result = ncclCommUserRank(*handle, &rank);
      const ncclResult_t size_result = rank_result == ncclSuccess ? ncclCommCount(*handle, &size) : rank_result;
      if (size_result != ncclSuccess) raise(size_result, "ncclCommUserRank / ncclCommCount of the split", -1);
    } catch (...) {
      if (*handle != nullptr) (void)ncclCommAbort(*handle);
      (void)handle.release();
      abort();
      throw;
    }
    return std::make_unique<NcclTransport>(*handle, rank, size, device_, timeout_s_);
  }

 private:
  void check_usable() const {
    if (comm_ == nullptr)
      fail(A2A_ERROR_TRANSPORT, "rank ", rank_, ": the NCCL communicator was aborted after an earlier failure");
  }
  void require_contiguous(const Span& span, const char* kind, int peer) const {
    if (!span.is_contiguous())
      fail(A2A_ERROR_INTERNAL, "nccl: ", kind, " peer ", peer, " with a strided span (the algorithms pack it)");
  }
  [[noreturn]] void raise(ncclResult_t result, const char* what, int peer) const {
    const char* detail = comm_ != nullptr ? ncclGetLastError(comm_) : "";
    const std::string on_peer = peer >= 0 ? cat(" (peer ", peer, ")") : std::string();
    fail(A2A_ERROR_TRANSPORT, "rank ", rank_, " of ", size_, ": ", what, on_peer, " failed on CUDA device ", device_,
         ": ", ncclGetErrorString(result), (detail && *detail) ? cat("; ", detail) : std::string());
  }
  // Enqueues the calls of `enqueue` as one NCCL group and waits (bounded)
  // until it is enqueued; a call that fails closes the group first.
  template <typename Fn>
  void grouped(const char* what, Fn&& enqueue) {
    check_usable();
    const CurrentDevice current(device_);
    call(ncclGroupStart(), "ncclGroupStart");
    try {
      enqueue();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    settle(ncclGroupEnd(), what);
  }
  // For calls inside a group, which only record the operation.
  void call(ncclResult_t result, const char* what, int peer = -1) const {
    if (result != ncclSuccess && result != ncclInProgress) raise(result, what, peer);
  }
  // Waits, bounded, until a call that may return ncclInProgress has finished
  // (been enqueued, for the stream-ordered operations).
  void settle(ncclResult_t result, const char* what) { settle_on(comm_, result, what); }
  // The same for a call on `comm` (this communicator, or one split from it).
  void settle_on(ncclComm_t comm, ncclResult_t result, const char* what) {
    if (result != ncclSuccess && result != ncclInProgress) raise(result, what, -1);
    const bool settled = poll_until(timeout_s_, [&] {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) raise(query, "ncclCommGetAsyncError", -1);
      if (state != ncclSuccess && state != ncclInProgress) raise(state, what, -1);
      return state == ncclSuccess;
    });
    if (!settled)
      fail(A2A_ERROR_TIMEOUT, "rank ", rank_, " of ", size_, ": timed out after ", timeout_s_, " s in ", what,
           ": another rank did not take part (it may have failed, be stuck, or be calling something else); raise "
           "A2A_TIMEOUT_S if it is only slow");
  }

  int rank_;
  int size_;
  int device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

void nccl_unique_id(void* id) {
  ncclUniqueId unique_id;
  const ncclResult_t result = ncclGetUniqueId(&unique_id);
  if (result != ncclSuccess)
    fail(A2A_ERROR_TRANSPORT, "ncclGetUniqueId failed: ", ncclGetErrorString(result), "; ", ncclGetLastError(nullptr));
  std::memcpy(id, &unique_id, sizeof unique_id);
}

std::unique_ptr<Transport> make_nccl_transport(const void* id, int size, int rank, int cuda_device, double timeout_s) {
  return std::make_unique<NcclTransport>(id, size, rank, cuda_device < 0 ? current_cuda_device() : cuda_device,
                                         timeout_s);
}

std::unique_ptr<Transport> split_nccl_transport(Transport& parent, int color, int key) {
  auto* nccl = dynamic_cast<NcclTransport*>(&parent);
  if (nccl == nullptr)
    fail(A2A_ERROR_INTERNAL, "split_nccl_transport: the ", parent.name(), " transport is not a NCCL transport");
  return nccl->split(color, key);
}

}  // namespace a2a
