#pragma once
#include <cstdint>
struct __half { uint16_t x; };
