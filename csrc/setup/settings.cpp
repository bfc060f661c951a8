#include "setup/settings.hpp"

#include <cstdlib>

#include "core/error.hpp"

namespace a2a {

long env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "environment variable ", name, "='", text, "' is not a non-negative integer");
  return value;
}

double timeout_from(const a2a_comm_config_t& config) {
  if (config.timeout_s > 0) return config.timeout_s;
  const char* text = std::getenv("A2A_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || value <= 0)
    fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_TIMEOUT_S='", text, "' is not a positive number of seconds");
  return value;
}

bool cross_check_from(const a2a_comm_config_t& config) {
  if (config.cross_check == 0 || config.cross_check == 1) return config.cross_check == 1;
  if (config.cross_check != -1)
    fail(A2A_ERROR_INVALID_ARGUMENT, "config.cross_check=", config.cross_check, " is not 1 (check), 0 (no check) or -1 "
         "(A2A_CROSS_CHECK)");
  const long value = env_int("A2A_CROSS_CHECK");
  if (value > 1) fail(A2A_ERROR_INVALID_ARGUMENT, "A2A_CROSS_CHECK=", value, " is not 1 (check) or 0 (no check)");
  return value != 0;
}

}  // namespace a2a
