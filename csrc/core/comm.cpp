#include "core/comm.hpp"

#include <cstring>
#include <functional>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace a2a {

Comm::Comm(std::unique_ptr<Transport> transport, std::unique_ptr<Device> device, Topology topology,
           bool use_strided_spans)
    : transport_(std::move(transport)),
      device_(std::move(device)),
      topology_(std::move(topology)),
      use_strided_spans_(use_strided_spans && transport_->supports_strided()) {}

void Comm::mark_broken(const std::string& why) {
  if (broken_reason_.empty()) broken_reason_ = why;
}

void Comm::check_usable(const char* op) const {
  if (!broken_reason_.empty())
    fail(A2A_ERROR_TRANSPORT, op, " on rank ", rank(),
         ": this communicator is unusable after an earlier failure (", broken_reason_,
         "); create a new one");
}

namespace {

// A stable op code so that two ranks calling different collectives disagree.
int64_t op_code(const char* op) { return static_cast<int64_t>(std::hash<std::string>{}(op) & 0x7fffffff); }

std::string describe(const char* name, int64_t value) {
  if (std::strcmp(name, "dtype") == 0) return dtype_name(value);
  if (std::strcmp(name, "algo") == 0) return algo_name(value);
  return std::to_string(value);
}

}  // namespace

void Comm::agree(const char* op, const std::vector<Field>& fields, const std::string& local_error) {
  check_usable(op);
  ++sequence_;
  // One allreduce(MAX) over [error flag, op, fields..., -op, -fields...]
  // yields the max and the min of every field at once. The vector has the
  // same length on every rank whatever `op` is, so that ranks calling
  // different collectives still meet in one allreduce.
  constexpr size_t kMaxFields = 24;
  if (fields.size() > kMaxFields) fail(A2A_ERROR_INTERNAL, op, ": too many fields to agree on");
  const size_t n = kMaxFields + 1;
  agreement_.op = op;
  agreement_.fields = fields;
  agreement_.local_error = local_error;
  agreement_.failed = false;
  std::vector<int64_t>& values = agreement_.values;
  values.assign(1 + 2 * n, 0);
  values[0] = local_error.empty() ? 0 : 1;
  values[1] = op_code(op);
  for (size_t i = 0; i < fields.size(); ++i) values[2 + i] = fields[i].value;
  for (size_t i = 0; i < n; ++i) values[1 + n + i] = -values[1 + i];
  try {
    transport_->start_agreement(values.data(), values.size(), [this] { judge(); });
    if (!local_error.empty()) transport_->finish_agreement();  // throws: this rank's input is bad
  } catch (...) {
    recover(op);
  }
}

void Comm::recover(const char* op) {
  try {
    throw;
  } catch (const Failure& e) {
    if (agreement_.failed) {
      // Every rank took the same verdict and is here too.
      agreement_.failed = false;
      try {
        transport_->reset();
      } catch (const Failure& reset_error) {
        mark_broken(reset_error.what());
      }
      throw;
    }
    const std::string message = std::strncmp(e.what(), op, std::strlen(op)) == 0 ? e.what() : cat(op, ": ", e.what());
    mark_broken(message);
    throw Failure(e.status(), message);
  }
}

void Comm::judge() {
  const std::vector<int64_t>& values = agreement_.values;
  const size_t n = (values.size() - 1) / 2;
  const char* op = agreement_.op;
  const std::string& local_error = agreement_.local_error;
  const bool agreed = values[0] == 0 && [&] {
    for (size_t i = 1; i <= n; ++i)
      if (values[i] != -values[n + i]) return false;
    return true;
  }();
  if (agreed) return;
  agreement_.failed = true;

  // Slow path, taken by every rank together: gather the offending value from
  // all ranks so that the message can name them.
  auto gather = [&](int64_t mine) {
    std::vector<int64_t> all(size());
    transport_->allgather(&mine, all.data(), sizeof(int64_t));
    return all;
  };
  if (values[0] != 0) {
    auto flags = gather(local_error.empty() ? 0 : 1);
    if (!local_error.empty()) fail(A2A_ERROR_INVALID_ARGUMENT, local_error);
    std::string ranks;
    for (int r = 0; r < size(); ++r)
      if (flags[r]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    fail(A2A_ERROR_REMOTE, op, " on rank ", rank(), ": rank(s) ", ranks,
         " rejected their input (see the error on those ranks); no data was exchanged");
  }
  if (values[1] != -values[1 + n]) {
    constexpr size_t kNameBytes = 32;
    char mine[kNameBytes] = {};
    std::strncpy(mine, op, kNameBytes - 1);
    std::vector<char> names(kNameBytes * size());
    transport_->allgather(mine, names.data(), kNameBytes);
    std::string detail;
    for (int r = 0; r < size(); ++r)
      detail += cat(r > 0 ? ", " : "", "rank ", r, ": ", &names[r * kNameBytes]);
    fail(A2A_ERROR_MISMATCH, op, " on rank ", rank(),
         ": ranks called different collectives on the same communicator at the same time (",
         detail, ")");
  }
  const std::vector<Field>& fields = agreement_.fields;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (values[2 + i] == -values[2 + n + i]) continue;
    auto all = gather(fields[i].value);
    std::string detail;
    for (int r = 0; r < size(); ++r) {
      if (r > 0) detail += ", ";
      detail += cat("rank ", r, ": ", describe(fields[i].name, all[r]));
    }
    std::string context;
    for (const auto& f : fields) context += cat(" ", f.name, "=", describe(f.name, f.value));
    fail(A2A_ERROR_MISMATCH, op, " on rank ", rank(), ": '", fields[i].name,
         "' differs across ranks (", detail, "); this rank has", context);
  }
  fail(A2A_ERROR_MISMATCH, op, " on rank ", rank(), ": arguments differ across ranks");
}

}  // namespace a2a
