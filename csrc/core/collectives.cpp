#include "core/collectives.hpp"

#include <climits>
#include <functional>
#include <mutex>
#include <set>

#include "core/debug.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/reduce_exchanges.hpp"

namespace a2a {

namespace {

// Collects the first local problem with the arguments; an empty string means
// none. Problems are not thrown at once: every rank first has to learn about
// them in Comm::agree, or the other ranks would wait for this one.
class Checker {
 public:
  Checker(const Comm& comm, const char* op) : comm_(comm), op_(op) {}
  template <typename... Args>
  void require(bool ok, Args&&... args) {
    if (!ok && error_.empty()) error_ = cat(op_, " on rank ", comm_.rank(), " of ", comm_.size(), ": ", std::forward<Args>(args)...);
  }
  void dtype_and_algo(a2a_dtype_t dtype, a2a_algo_t algo) {
    require(dtype_size(dtype) != 0, "unsupported dtype code ", static_cast<int>(dtype),
            " (supported: float32, float64, float16, bfloat16, int8, int32, int64, uint8)");
    require(algo == A2A_ALGO_LINEAR || algo == A2A_ALGO_2DH, "unknown algorithm code ", static_cast<int>(algo),
            " (supported: linear, 2dh)");
    if (algo == A2A_ALGO_2DH)
      require(comm_.topology().regular(), "algo=2dh needs nodes of equal size: ", comm_.topology().irregular_reason);
  }
  void buffers(const void* send, const void* recv, size_t send_bytes, size_t recv_bytes) {
    require(send_bytes == 0 || send != nullptr, "send buffer is NULL but holds ", send_bytes, " bytes");
    require(recv_bytes == 0 || recv != nullptr, "recv buffer is NULL but must hold ", recv_bytes, " bytes");
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    const bool overlap = send_bytes != 0 && recv_bytes != 0 && s < r + recv_bytes && r < s + send_bytes;
    require(!overlap, "send and recv buffers overlap; the collectives are out of place");
  }
  void workspace(const void* workspace, size_t given, size_t needed) {
    require(given >= needed, "workspace of ", given, " bytes is smaller than the ", needed, " bytes required");
    require(needed == 0 || workspace != nullptr, "workspace is NULL but ", needed, " bytes are required");
  }
  const std::string& error() const { return error_; }

 private:
  const Comm& comm_;
  const char* op_;
  std::string error_;
};

bool multiply_overflows(size_t a, size_t b, size_t* product) { return __builtin_mul_overflow(a, b, product); }

// Where the comm checks in band, every exchange of the algorithms carries the
// check (Comm::begin_in_band): no round of its own.
bool in_band(const Comm& comm) { return comm.checks_in_band() && comm.cross_checks() && comm.size() > 1; }

// Agrees on `fields` and runs the algorithm: with the check in band (handed
// to the algorithm, whose exchanges carry it) where the comm allows it and
// this rank's input is valid; else after agree(), which on an in-band comm
// tells every rank of this rank's rejected input.
void agree_and_run(Comm& comm, const char* op, std::vector<Field> fields, const std::string& error,
                   const std::function<void(InBandCheck*)>& algorithm) {
  if (in_band(comm) && error.empty()) {
    InBandCheck check = comm.begin_in_band(op, std::move(fields));
    comm.run(op, [&] { algorithm(&check); });
    return;
  }
  comm.agree(op, fields, error);
  comm.run(op, [&] { algorithm(nullptr); });
}

// A2A_DEBUG=INFO: the algorithm and path of each kind of call, the first time
// this process sees it (a line per call would drown a training loop).
void log_choice(const Comm& comm, const char* op, a2a_algo_t algo, const std::string& path) {
  if (!debug::enabled(debug::Level::kInfo)) return;
  static std::mutex mutex;
  static std::set<std::string> seen;
  const std::string choice =
      cat(op, ": algo ", algo_name(algo), ", ", path, ", argument check ", in_band(comm) ? "in band" : "by round");
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(choice).second) debug::info(choice, " (", comm.size(), " ranks)");
}

}  // namespace

// ---------------------------------------------------------------------------

size_t all_to_all_workspace_size(const Comm& comm, size_t count, a2a_dtype_t dtype, a2a_algo_t algo) {
  if (algo != A2A_ALGO_2DH || !comm.topology().regular()) return 0;
  return all_to_all_2dh_workspace(comm.topology(), count * dtype_size(dtype));
}

void all_to_all(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_algo_t algo,
                void* workspace, size_t workspace_bytes) {
  const char* op = "all_to_all";
  Checker check(comm, op);
  check.dtype_and_algo(dtype, algo);
  size_t chunk_bytes = 0, total_bytes = 0;
  check.require(!multiply_overflows(count, dtype_size(dtype), &chunk_bytes) &&
                    !multiply_overflows(chunk_bytes, comm.size(), &total_bytes),
                count, " elements per peer overflow the address space");
  if (check.error().empty()) {
    check.buffers(send, recv, total_bytes, total_bytes);
    check.workspace(workspace, workspace_bytes, all_to_all_workspace_size(comm, count, dtype, algo));
  }
  log_choice(comm, op, algo, algo == A2A_ALGO_2DH ? "intra-node then inter-node" : "one message per peer");
  agree_and_run(comm, op, {{"dtype", dtype}, {"algo", algo}, {"count per peer", static_cast<int64_t>(count)}},
                check.error(), [&](InBandCheck* in_band) {
                  if (algo == A2A_ALGO_2DH)
                    all_to_all_2dh(comm, send, recv, chunk_bytes, workspace, in_band);
                  else
                    all_to_all_linear(comm, send, recv, chunk_bytes, in_band);
                });
}

// ---------------------------------------------------------------------------
// Dense collectives: allgather, allreduce, reduce-scatter

namespace {

enum class Dense { kAllGather, kAllReduce, kReduceScatter };

// Checks one dense collective; returns the bytes of one rank's block (count
// elements) and leaves the first local problem in *error.
size_t check_dense(Comm& comm, const char* op, Dense kind, const void* send, void* recv, size_t count,
                   a2a_dtype_t dtype, int reduce_op, std::string* error) {
  Checker check(comm, op);
  check.require(dtype_size(dtype) != 0, "unsupported dtype code ", static_cast<int>(dtype),
                " (supported: float32, float64, float16, bfloat16, int8, int32, int64, uint8)");
  if (kind != Dense::kAllGather)
    check.require(reduce_op == A2A_SUM || reduce_op == A2A_MAX || reduce_op == A2A_MIN, "unknown reduction code ",
                  reduce_op, " (supported: sum, max, min)");
  size_t block = 0, total = 0;
  check.require(!multiply_overflows(count, dtype_size(dtype), &block) &&
                    !multiply_overflows(block, comm.size(), &total),
                count, " elements per rank overflow the address space");
  if (check.error().empty()) {
    const size_t send_bytes = kind == Dense::kReduceScatter ? total : block;
    const size_t recv_bytes = kind == Dense::kAllGather ? total : block;
    if (kind == Dense::kAllReduce && send == recv)  // in place
      check.buffers(send, nullptr, send_bytes, 0);
    else
      check.buffers(send, recv, send_bytes, recv_bytes);
    check.require(recv_bytes == 0 || recv != nullptr, "recv buffer is NULL but must hold ", recv_bytes, " bytes");
  }
  *error = check.error();
  return block;
}

std::vector<Field> dense_fields(a2a_dtype_t dtype, size_t count, int reduce_op) {
  return {{"dtype", dtype}, {"count", static_cast<int64_t>(count)}, {"reduce_op", reduce_op}};
}

}  // namespace

// In band, the gather is one exchange over the world that carries the check;
// else the transport's own (NCCL's), after agree().
void all_gather(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype) {
  const char* op = "all_gather";
  std::string error;
  const size_t block = check_dense(comm, op, Dense::kAllGather, send, recv, count, dtype, A2A_SUM, &error);
  agree_and_run(comm, op, dense_fields(dtype, count, A2A_SUM), error, [&](InBandCheck* in_band) {
    if (in_band != nullptr)
      all_gather_exchange(comm, send, recv, block, in_band);
    else if (block != 0)
      comm.transport().allgather(send, recv, block);
  });
}

// In band, the reductions are a2a's own exchanges, which carry the check
// (core/reduce_exchanges.hpp: two rounds for all_reduce, one for
// reduce_scatter); else the transport's (MPI's, NCCL's) after agree().
void all_reduce(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t reduce) {
  const char* op = "all_reduce";
  std::string error;
  check_dense(comm, op, Dense::kAllReduce, send, recv, count, dtype, reduce, &error);
  const auto reduce_op = static_cast<ReduceOp>(reduce);
  agree_and_run(comm, op, dense_fields(dtype, count, reduce), error, [&](InBandCheck* in_band) {
    if (in_band != nullptr)
      all_reduce_exchanges(comm, send, recv, count, dtype, reduce_op, in_band);
    else if (count != 0)
      comm.transport().allreduce(send, recv, count, dtype, reduce_op);
  });
}

void reduce_scatter(Comm& comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype, a2a_reduce_op_t reduce) {
  const char* op = "reduce_scatter";
  std::string error;
  check_dense(comm, op, Dense::kReduceScatter, send, recv, count, dtype, reduce, &error);
  const auto reduce_op = static_cast<ReduceOp>(reduce);
  agree_and_run(comm, op, dense_fields(dtype, count, reduce), error, [&](InBandCheck* in_band) {
    if (in_band != nullptr)
      reduce_scatter_exchange(comm, send, recv, std::vector<size_t>(comm.size(), count), dtype, reduce_op, in_band);
    else if (count != 0)
      comm.transport().reduce_scatter(send, recv, count, dtype, reduce_op);
  });
}

// ---------------------------------------------------------------------------
// Uneven dense collectives: all_gather_v, reduce_scatter_v

namespace {

// A 64-bit digest of the counts, compared across ranks instead of the counts
// themselves: 8 bytes per peer whatever the world size. Each step is a
// bijection of the running hash, so counts that differ in one entry always
// differ in digest.
uint64_t counts_digest(const std::vector<int64_t>& counts) {
  uint64_t hash = 0x9e3779b97f4a7c15ull ^ counts.size();
  for (int64_t count : counts) {
    hash = (hash ^ static_cast<uint64_t>(count)) * 0xff51afd7ed558ccdull;
    hash ^= hash >> 32;
  }
  return hash;
}

constexpr const char* kCountsDigest = "counts digest";

// Every rank holds every digest (or the same verdict on them), so every rank
// comes here when one differs: one allgather of the counts lets them all name
// the same entry.
[[noreturn]] void explain_counts(Comm& comm, const char* op, const std::vector<int64_t>& mine, bool data_moved) {
  const int world = comm.size();
  std::vector<int64_t> table(static_cast<size_t>(world) * world);
  comm.run(op, [&] { comm.control().allgather(mine.data(), table.data(), world * sizeof(int64_t)); });
  for (int r = 1; r < world; ++r)
    for (int i = 0; i < world; ++i)
      if (table[static_cast<size_t>(r) * world + i] != table[i])
        throw Disagreement(A2A_ERROR_MISMATCH,
                           cat(op, " on rank ", comm.rank(), ": 'counts' differ across ranks: rank ", r,
                               " passed counts[", i, "] = ", table[static_cast<size_t>(r) * world + i],
                               " where rank 0 passed ", table[i], " (elements); every rank must pass the same ", world,
                               " counts (counts[i]: rank i's block); ",
                               data_moved ? "the output may hold what the other ranks sent" : "no data was exchanged"));
  fail(A2A_ERROR_INTERNAL, op, " on rank ", comm.rank(), ": the digests of the counts differ but the counts do not");
}

// One uneven dense collective's own checks: returns counts[i] in elements,
// this rank's counts (zeros where it rejected them) and the first local
// problem in *error.
std::vector<size_t> check_dense_v(Comm& comm, const char* op, Dense kind, const void* send, void* recv,
                                  const int64_t* counts, a2a_dtype_t dtype, int reduce_op, std::vector<int64_t>* mine,
                                  std::string* error) {
  const int world = comm.size();
  const size_t item = dtype_size(dtype);
  Checker check(comm, op);
  check.require(item != 0, "unsupported dtype code ", static_cast<int>(dtype),
                " (supported: float32, float64, float16, bfloat16, int8, int32, int64, uint8)");
  if (kind != Dense::kAllGather)
    check.require(reduce_op == A2A_SUM || reduce_op == A2A_MAX || reduce_op == A2A_MIN, "unknown reduction code ",
                  reduce_op, " (supported: sum, max, min)");
  check.require(counts != nullptr, "counts is NULL; pass ", world, " element counts, one per rank");
  std::vector<size_t> sizes(world, 0);
  size_t total = 0;  // bytes of every block
  for (int i = 0; i < world && check.error().empty(); ++i) {
    size_t bytes = 0;
    check.require(counts[i] >= 0, "counts[", i, "] is negative (", counts[i], ")");
    check.require(counts[i] < 0 || !multiply_overflows(static_cast<size_t>(counts[i]), item, &bytes),
                  "counts[", i, "] (", counts[i], " elements) overflows the address space");
    check.require(!__builtin_add_overflow(total, bytes, &total), "the counts sum to more than the address space");
    sizes[i] = static_cast<size_t>(counts[i]);
  }
  mine->assign(world, 0);
  if (check.error().empty()) {
    mine->assign(counts, counts + world);
    const size_t block = sizes[comm.rank()] * item;
    check.buffers(send, recv, kind == Dense::kAllGather ? block : total, kind == Dense::kAllGather ? total : block);
  }
  *error = check.error();
  return sizes;
}

// Agrees on an uneven dense collective by round, counts included: each rank
// sends the digest of its counts to every rank (over the control transport,
// as all-to-all-v counts go; in band where the comm allows), so counts that
// differ on one rank fail every rank alike.
void agree_dense_v(Comm& comm, const char* op, std::vector<Field> fields, const std::string& error,
                   const std::vector<int64_t>& mine) {
  comm.require_control_outside_capture(op);
  const uint64_t digest = counts_digest(mine);
  std::vector<uint64_t> digests(comm.size(), 0);
  comm.agree_in_exchange(
      op, fields, error, comm.control(), [&](int) { return Span::contiguous(&digest, sizeof digest); },
      [&](int r) { return Span::contiguous(&digests[r], sizeof(uint64_t)); });
  for (uint64_t other : digests)
    if (other != digest) explain_counts(comm, op, mine, false);
}

// Agrees on an uneven dense collective and runs it: in band, its own
// exchanges carry the check, the counts' digest as one of its fields; else
// the digests' round (agree_dense_v), then the transport's collective.
void agree_and_run_v(Comm& comm, const char* op, std::vector<Field> fields, const std::string& error,
                     const std::vector<int64_t>& mine, const std::function<void(InBandCheck*)>& algorithm) {
  if (!in_band(comm) || !error.empty()) {
    agree_dense_v(comm, op, fields, error, mine);
    comm.run(op, [&] { algorithm(nullptr); });
    return;
  }
  fields.push_back({kCountsDigest, static_cast<int64_t>(counts_digest(mine))});
  try {
    InBandCheck check = comm.begin_in_band(op, fields);
    comm.run(op, [&] { algorithm(&check); });
  } catch (const FieldDisagreement& e) {
    if (std::string(e.field()) != kCountsDigest) throw;
    explain_counts(comm, op, mine, true);
  }
}

}  // namespace

// In band, one exchange over the world moves the blocks and carries the
// check; else the transport's gather after the check's round.
void all_gather_v(Comm& comm, const void* send, void* recv, const int64_t* counts, a2a_dtype_t dtype) {
  const char* op = "all_gather_v";
  std::vector<int64_t> mine;
  std::string error;
  std::vector<size_t> bytes = check_dense_v(comm, op, Dense::kAllGather, send, recv, counts, dtype, A2A_SUM, &mine,
                                            &error);
  size_t total = 0;
  for (size_t& b : bytes) total += (b *= dtype_size(dtype));
  agree_and_run_v(comm, op, {{"dtype", dtype}, {"reduce_op", A2A_SUM}}, error, mine, [&](InBandCheck* in_band) {
    if (in_band != nullptr)
      all_gather_v_exchange(comm, send, recv, bytes, in_band);
    else if (total != 0)
      comm.transport().allgather_v(send, recv, bytes);
  });
}

// In band, one exchange of the blocks that carries the check, reduced here
// (core/reduce_exchanges.hpp); else the transport's after the check's round.
void reduce_scatter_v(Comm& comm, const void* send, void* recv, const int64_t* counts, a2a_dtype_t dtype,
                      a2a_reduce_op_t reduce) {
  const char* op = "reduce_scatter_v";
  std::vector<int64_t> mine;
  std::string error;
  const std::vector<size_t> sizes =
      check_dense_v(comm, op, Dense::kReduceScatter, send, recv, counts, dtype, reduce, &mine, &error);
  size_t total = 0;
  for (size_t count : sizes) total += count;
  const auto reduce_op = static_cast<ReduceOp>(reduce);
  agree_and_run_v(comm, op, {{"dtype", dtype}, {"reduce_op", reduce}}, error, mine, [&](InBandCheck* in_band) {
    if (in_band != nullptr)
      reduce_scatter_exchange(comm, send, recv, sizes, dtype, reduce_op, in_band);
    else if (total != 0)
      comm.transport().reduce_scatter_v(send, recv, sizes, dtype, reduce_op);
  });
}

// ---------------------------------------------------------------------------

namespace {

constexpr int kMaxDims = 16;
const char* const kShapeNames[kMaxDims] = {"shape[0]",  "shape[1]",  "shape[2]",  "shape[3]", "shape[4]",  "shape[5]",
                                           "shape[6]",  "shape[7]",  "shape[8]",  "shape[9]", "shape[10]", "shape[11]",
                                           "shape[12]", "shape[13]", "shape[14]", "shape[15]"};

std::string shape_text(const int64_t* shape, int ndim) {
  std::string text = "(";
  for (int i = 0; i < ndim; ++i) text += cat(i ? ", " : "", shape[i]);
  return text + (ndim == 1 ? ",)" : ")");
}

// Checks the flexible all-to-all's arguments and computes its layout.
FlexLayout flex_layout(Checker& check, int world, const int64_t* shape, int ndim, int split_axis, int concat_axis,
                       a2a_dtype_t dtype) {
  FlexLayout layout{1, 1, 1, 1};
  check.require(shape != nullptr && ndim >= 1 && ndim <= kMaxDims, "ndim must be in [1, ", kMaxDims, "], got ", ndim);
  if (!check.error().empty()) return layout;
  // Messages are built only on failure: shape_text is costly next to a
  // small collective.
  if (split_axis < 0 || split_axis >= ndim)
    check.require(false, "split_axis ", split_axis, " is out of range for shape ", shape_text(shape, ndim));
  if (concat_axis < 0 || concat_axis >= ndim)
    check.require(false, "concat_axis ", concat_axis, " is out of range for shape ", shape_text(shape, ndim));
  for (int i = 0; i < ndim; ++i)
    if (shape[i] < 0) check.require(false, "negative dimension in shape ", shape_text(shape, ndim));
  if (!check.error().empty()) return layout;
  if (shape[split_axis] % world != 0)
    check.require(false, "shape ", shape_text(shape, ndim), " ", dtype_name(dtype), ": dimension ", split_axis, " (",
                  shape[split_axis], ") is not divisible by the world size ", world);
  if (!check.error().empty()) return layout;
  std::vector<size_t> chunk(shape, shape + ndim);
  chunk[split_axis] /= world;
  bool overflow = false;
  auto product = [&](const std::vector<size_t>& dims, int begin, int end) {
    size_t p = 1;
    for (int i = begin; i < end; ++i) overflow |= multiply_overflows(p, dims[i], &p);
    return p;
  };
  const size_t item = dtype_size(dtype);
  size_t total = 0;
  overflow |= multiply_overflows(product(chunk, 0, ndim), item, &total) ||
              multiply_overflows(total, static_cast<size_t>(world), &total);
  if (overflow) check.require(false, "shape ", shape_text(shape, ndim), " ", dtype_name(dtype), " overflows the address space");
  layout.split_outer = product(chunk, 0, split_axis);
  layout.split_inner = product(chunk, split_axis, ndim) * item;
  layout.concat_outer = product(chunk, 0, concat_axis);
  layout.concat_inner = product(chunk, concat_axis, ndim) * item;
  return layout;
}

std::vector<Field> flex_fields(a2a_dtype_t dtype, a2a_algo_t algo, const int64_t* shape, int ndim, int split_axis,
                               int concat_axis) {
  std::vector<Field> fields{{"dtype", dtype}, {"algo", algo}, {"ndim", ndim}, {"split_axis", split_axis},
                            {"concat_axis", concat_axis}};
  if (shape != nullptr)
    for (int i = 0; i < ndim && i < kMaxDims; ++i) fields.push_back({kShapeNames[i], shape[i]});
  return fields;
}

}  // namespace

size_t all_to_all_flex_workspace_size(const Comm& comm, const int64_t* shape, int ndim, int split_axis,
                                      int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo) {
  Checker check(comm, "all_to_all_flex_workspace_size");
  check.dtype_and_algo(dtype, algo);
  check.require(flex_path_setting_error().empty(), flex_path_setting_error());
  FlexLayout layout = flex_layout(check, comm.size(), shape, ndim, split_axis, concat_axis, dtype);
  if (!check.error().empty()) fail(A2A_ERROR_INVALID_ARGUMENT, check.error());
  return all_to_all_flex_workspace(comm, layout, algo);
}

void all_to_all_flex(Comm& comm, const void* send, void* recv, const int64_t* shape, int ndim, int split_axis,
                     int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo, void* workspace,
                     size_t workspace_bytes) {
  const char* op = "all_to_all_flex";
  Checker check(comm, op);
  check.dtype_and_algo(dtype, algo);
  check.require(flex_path_setting_error().empty(), flex_path_setting_error());
  FlexLayout layout = flex_layout(check, comm.size(), shape, ndim, split_axis, concat_axis, dtype);
  std::vector<Field> fields = flex_fields(dtype, algo, shape, ndim, split_axis, concat_axis);
  if (check.error().empty()) {
    const size_t total = layout.chunk_bytes() * comm.size();
    check.buffers(send, recv, total, total);
    check.workspace(workspace, workspace_bytes, all_to_all_flex_workspace(comm, layout, algo));
    const FlexPath path = choose_flex_path(comm, layout, algo);
    log_choice(comm, op, algo, cat("path ", flex_path_name(path)));
    // Pieces send several messages per peer, every other path one (datatypes
    // and packed interoperate): ranks must agree on which (A2A_FLEX_PATH).
    fields.push_back({"pieces path", path == FlexPath::kPieces ? 1 : 0});
  }
  agree_and_run(comm, op, std::move(fields), check.error(),
                [&](InBandCheck* in_band) { all_to_all_flex(comm, send, recv, layout, algo, workspace, in_band); });
}

// ---------------------------------------------------------------------------

namespace {

// The send side of an uneven all-to-all: dtype, algo and the counts (rows of
// row_elements). Returns the bytes of one row and adds the total send bytes
// to *send_total.
size_t check_send_counts(Checker& check, int world, const int64_t* send_counts, size_t row_elements,
                         a2a_dtype_t dtype, a2a_algo_t algo, size_t* send_total) {
  check.dtype_and_algo(dtype, algo);
  check.require(send_counts != nullptr, "send_counts is NULL");
  size_t row_bytes = 0;
  check.require(!multiply_overflows(row_elements, dtype_size(dtype), &row_bytes) && row_bytes <= INT64_MAX,
                "row of ", row_elements, " elements overflows");
  for (int peer = 0; peer < world && check.error().empty(); ++peer) {
    size_t bytes = 0;
    check.require(send_counts[peer] >= 0, "send count for peer ", peer, " is negative (", send_counts[peer], ")");
    check.require(send_counts[peer] < 0 || !multiply_overflows(static_cast<size_t>(send_counts[peer]), row_bytes, &bytes),
                  "send count for peer ", peer, " (", send_counts[peer], " rows of ", row_bytes, " bytes) overflows");
    check.require(!__builtin_add_overflow(*send_total, bytes, send_total), "total send size overflows");
  }
  return row_bytes;
}

// Where each rank's block of rows[rank] rows starts, in bytes, and (last) the total.
std::vector<size_t> block_offsets(const int64_t* rows, int world, size_t row_bytes) {
  std::vector<size_t> offsets(static_cast<size_t>(world) + 1, 0);
  for (int peer = 0; peer < world; ++peer) offsets[peer + 1] = offsets[peer] + static_cast<size_t>(rows[peer]) * row_bytes;
  return offsets;
}

}  // namespace

VPlan::VPlan(Comm& comm, const int64_t* send_counts, size_t row_elements, a2a_dtype_t dtype, a2a_algo_t algo,
             const char* op)
    : comm_(comm), comm_lifetime_(comm.lifetime()), dtype_(dtype), algo_(algo) {
  comm.require_control_outside_capture(op);
  const int world = comm.size();
  Checker check(comm, op);
  size_t send_total = 0;
  const size_t row_bytes = check_send_counts(check, world, send_counts, row_elements, dtype, algo, &send_total);
  // recv_counts: one int64 from every rank, in rows; bytes follow. Counts
  // live on the host: they go over the control transport, and carry the
  // argument check where the comm checks in band.
  std::vector<int64_t> send_rows(world, 0);
  if (check.error().empty()) send_rows.assign(send_counts, send_counts + world);
  recv_counts_.assign(world, 0);
  comm.agree_in_exchange(
      op, {{"dtype", dtype}, {"algo", algo}, {"row elements", static_cast<int64_t>(row_elements)}}, check.error(),
      comm.control(), [&](int i) { return Span::contiguous(&send_rows[i], sizeof(int64_t)); },
      [&](int j) { return Span::contiguous(&recv_counts_[j], sizeof(int64_t)); });
  id_ = comm.sequence();
  const int64_t row = static_cast<int64_t>(row_bytes);
  bytes_.send.resize(world);
  bytes_.recv.resize(world);
  for (int peer = 0; peer < world; ++peer) {
    bytes_.send[peer] = send_rows[peer] * row;
    bytes_.recv[peer] = recv_counts_[peer] * row;
  }
  const Topology& topo = comm.topology();
  if (algo == A2A_ALGO_2DH && topo.num_nodes > 1 && topo.local_size > 1) {
    // Local peer l needs, for every node m, what this rank sends to (m, l).
    const int nodes = topo.num_nodes, locals = topo.local_size;
    std::vector<int64_t> by_local(static_cast<size_t>(nodes) * locals);
    for (int l = 0; l < locals; ++l)
      for (int m = 0; m < nodes; ++m) by_local[l * nodes + m] = bytes_.send[topo.global_rank(m, l)];
    bytes_.relay.assign(by_local.size(), 0);
    const size_t row_of_nodes = nodes * sizeof(int64_t);
    comm.run(op, [&] {
      exchange(
          comm.control(), node_group(topo),
          [&](int l) { return Span::contiguous(&by_local[l * nodes], row_of_nodes); },
          [&](int l) { return Span::contiguous(&bytes_.relay[l * nodes], row_of_nodes); });
    });
  }
  if (algo == A2A_ALGO_2DH) workspace_bytes_ = all_to_all_v_2dh_workspace(topo, bytes_);
}

void VPlan::execute(const void* send, void* recv, void* workspace, size_t workspace_bytes) {
  const char* op = "all_to_all_v";
  if (comm_lifetime_.expired())
    fail(A2A_ERROR_INVALID_ARGUMENT, op, ": the communicator of this plan was destroyed; a plan is used with the "
         "communicator it was made on, while that communicator exists");
  Checker check(comm_, op);
  size_t send_total = 0, recv_total = 0;
  for (auto b : bytes_.send) send_total += b;
  for (auto b : bytes_.recv) recv_total += b;
  check.buffers(send, recv, send_total, recv_total);
  check.workspace(workspace, workspace_bytes, workspace_bytes_);
  // dtype and algo were agreed at planning; the call itself must still match.
  agree_and_run(comm_, op, {{"dtype", dtype_}, {"algo", algo_}, {"plan", id_, true}}, check.error(),
                [&](InBandCheck* in_band) {
                  if (algo_ == A2A_ALGO_2DH)
                    all_to_all_v_2dh(comm_, send, recv, bytes_, workspace, in_band);
                  else
                    all_to_all_v_linear(comm_, send, recv, bytes_, in_band);
                });
}

// ---------------------------------------------------------------------------

VExchange::VExchange(Comm& comm, const void* send, const int64_t* send_counts, size_t row_elements,
                     a2a_dtype_t dtype, a2a_algo_t algo)
    : comm_(comm), comm_lifetime_(comm.lifetime()), send_(send) {
  const char* op = "all_to_all_v";
  const int world = comm.size();
  Checker check(comm, op);
  size_t send_total = 0;
  row_bytes_ = check_send_counts(check, world, send_counts, row_elements, dtype, algo, &send_total);
  if (check.error().empty()) check.buffers(send, nullptr, send_total, 0);
  send_bytes_ = send_total;
  // Linear on a comm that checks in band: one round. Any rank with bad input
  // takes the plan's path, whose check (a round of its own) the others see
  // as a disagreement: every rank fails alike. Rows of no bytes have counts
  // that no size tells: they take it too.
  if (!check.error().empty() || algo != A2A_ALGO_LINEAR || !comm.checks_in_band() || world == 1 ||
      row_bytes_ == 0) {
    plan_ = std::make_unique<VPlan>(comm, send_counts, row_elements, dtype, algo, op);
    recv_counts_ = plan_->recv_counts();
    return;
  }
  const std::vector<size_t> offsets = block_offsets(send_counts, world, row_bytes_);
  const char* bytes = static_cast<const char*>(send);
  log_choice(comm, op, algo, "counts in the messages' sizes (one round)");
  const std::vector<int64_t> sizes = comm.start_in_band(
      op, {{"dtype", dtype}, {"algo", algo}, {"row elements", static_cast<int64_t>(row_elements)}},
      [&](int peer) { return Span::contiguous(bytes + offsets[peer], offsets[peer + 1] - offsets[peer]); },
      row_bytes_);
  open_ = true;
  recv_counts_.resize(world);
  for (int peer = 0; peer < world; ++peer) recv_counts_[peer] = sizes[peer] / static_cast<int64_t>(row_bytes_);
}

VExchange::~VExchange() {
  try {
    drop();
  } catch (...) {  // the comm retired itself, or the plan's exchange failed: nothing more to drop
  }
}

void VExchange::drop() {
  if (finished_ || comm_lifetime_.expired()) return;
  finished_ = true;
  if (open_) {
    open_ = false;
    comm_.drop_in_band("all_to_all_v");
    return;
  }
  // The plan's exchange is a collective of its own, which the other ranks
  // run: it runs here too, into scratch.
  const size_t recv_total = block_offsets(recv_counts_.data(), comm_.size(), row_bytes_).back();
  DeviceBuffer rows(comm_.device(), DeviceBuffer::Kind::kDevice), workspace(comm_.device(), DeviceBuffer::Kind::kDevice);
  const double timeout_s = 60.0;
  plan_->execute(send_, rows.reserve(recv_total, timeout_s), workspace.reserve(plan_->workspace_bytes(), timeout_s),
                 plan_->workspace_bytes());
}

void VExchange::finish(void* recv, void* workspace, size_t workspace_bytes) {
  const char* op = "all_to_all_v";
  if (comm_lifetime_.expired())
    fail(A2A_ERROR_INVALID_ARGUMENT, op, ": the communicator of this exchange was destroyed before its finish");
  if (finished_)
    fail(A2A_ERROR_INVALID_ARGUMENT, op, " on rank ", comm_.rank(), ": this exchange was finished or dropped already");
  finished_ = true;
  if (plan_) {
    plan_->execute(send_, recv, workspace, workspace_bytes);
    return;
  }
  const std::vector<size_t> offsets = block_offsets(recv_counts_.data(), comm_.size(), row_bytes_);
  Checker check(comm_, op);
  check.buffers(send_, recv, send_bytes_, offsets.back());
  if (!check.error().empty()) {
    finished_ = false;
    drop();
    fail(A2A_ERROR_INVALID_ARGUMENT, check.error(), "; the rows sent here were dropped");
  }
  char* out = static_cast<char*>(recv);
  open_ = false;
  comm_.finish_in_band(
      op, [&](int peer) { return Span::contiguous(out + offsets[peer], offsets[peer + 1] - offsets[peer]); });
}

void report_invalid(Comm& comm, const char* op, const std::string& message) {
  comm.agree(op, {}, message.empty() ? std::string("invalid input") : message);
  fail(A2A_ERROR_INTERNAL, op, ": report_invalid reached the end without an error");
}

}  // namespace a2a
