#pragma once
#include <cstdint>
struct __nv_bfloat16 { uint16_t x; };
