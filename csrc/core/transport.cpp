#include "core/transport.hpp"

#include "core/error.hpp"

namespace a2a {

std::vector<int64_t> Transport::signed_start(uint32_t, const std::function<Span(int)>&) {
  fail(A2A_ERROR_INTERNAL, "the ", name(), " transport has no signed exchange (supports_signed_exchange() is false)");
}

void Transport::signed_finish(const std::function<Span(int)>&) {
  fail(A2A_ERROR_INTERNAL, "the ", name(), " transport has no signed exchange (supports_signed_exchange() is false)");
}

std::vector<int> Transport::signed_exchange(uint32_t signature, const std::function<Span(int)>& send_span,
                                            const std::function<Span(int)>& recv_span) {
  const std::vector<int64_t> sizes = signed_start(signature, send_span);
  std::vector<int> mismatched;
  for (int r = 0; r < size(); ++r)
    if (sizes[r] != static_cast<int64_t>(recv_span(r).bytes())) mismatched.push_back(r);
  signed_finish(recv_span);
  return mismatched;
}

}  // namespace a2a
