#include "setup/testing_comm.hpp"

#include <string>

#include "core/error.hpp"
#include "core/staging.hpp"
#include "setup/mpi_comm.hpp"

namespace a2a {

std::unique_ptr<Comm> create_staged_host_comm(MPI_Comm parent, const a2a_comm_config_t& config, const char* staging) {
  const std::string mode = staging == nullptr ? "" : staging;
  if (mode != "staged" && mode != "control" && mode != "predicted")
    fail(A2A_ERROR_INVALID_ARGUMENT, "testing staging mode '", mode, "': expected 'staged', 'control' or 'predicted'");
  if (config.device_type != A2A_DEVICE_CPU || config.transport != A2A_TRANSPORT_MPI)
    fail(A2A_ERROR_INVALID_ARGUMENT, "testing staging mode '", mode, "' runs host communicators only (device cpu, "
         "transport mpi)");
  // Kept by the communicator for its splits: captures by value.
  return create_mpi_comm(parent, config, [mode](CommParts& parts, double timeout_s) {
    Transport& host = *parts.control;
    if (mode == "staged" || mode == "predicted") {
      parts.data = parts.transports.emplace_back(std::make_unique<StagedTransport>(host, *parts.device, timeout_s)).get();
      // As on a communicator of MPI and NCCL: the check of a predicted call is posted.
      parts.predicts_check = mode == "predicted";
    } else {
      parts.control =
          parts.transports.emplace_back(std::make_unique<DeviceControlTransport>(host, *parts.device, timeout_s)).get();
      parts.control_waits_for_stream = true;
    }
  });
}

}  // namespace a2a
