#include "core/transport.hpp"

#include "core/error.hpp"

namespace a2a {

std::vector<int> Transport::signed_exchange(uint32_t, const std::function<Span(int)>&, const std::function<Span(int)>&) {
  fail(A2A_ERROR_INTERNAL, "the ", name(), " transport has no signed exchange (supports_signed_exchange() is false)");
}

}  // namespace a2a
