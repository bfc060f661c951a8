#include "core/transport.hpp"

#include "core/error.hpp"

namespace a2a {

namespace {

[[noreturn]] void no_signed_exchange(const char* transport) {
  fail(A2A_ERROR_INTERNAL, "the ", transport, " transport has no signed exchange (supports_signed_exchange() is false)");
}

}  // namespace

bool Transport::signed_exchange(const PeerGroup&, uint32_t, size_t, const std::function<Span(int, size_t)>&,
                                const std::function<Span(int, size_t)>&, int*) {
  no_signed_exchange(name());
}

std::vector<int64_t> Transport::signed_start(uint32_t, const std::function<Span(int)>&) { no_signed_exchange(name()); }

void Transport::signed_finish(const std::function<Span(int)>&) { no_signed_exchange(name()); }

void Transport::settle_disagreement() { no_signed_exchange(name()); }

void Transport::post_check(const PeerGroup&, uint32_t) { no_signed_exchange(name()); }

bool Transport::complete_check(int*) { no_signed_exchange(name()); }

}  // namespace a2a
