#pragma once

#include <cstddef>
#include <cstdint>

#include "a2a/a2a.h"

namespace a2a {

// Element size in bytes; 0 for a value outside the enum.
inline size_t dtype_size(a2a_dtype_t dtype) {
  switch (dtype) {
    case A2A_FLOAT32: return 4;
    case A2A_FLOAT64: return 8;
    case A2A_FLOAT16: return 2;
    case A2A_BFLOAT16: return 2;
    case A2A_INT8: return 1;
    case A2A_INT32: return 4;
    case A2A_INT64: return 8;
    case A2A_UINT8: return 1;
  }
  return 0;
}

inline const char* dtype_name(int64_t dtype) {
  switch (dtype) {
    case A2A_FLOAT32: return "float32";
    case A2A_FLOAT64: return "float64";
    case A2A_FLOAT16: return "float16";
    case A2A_BFLOAT16: return "bfloat16";
    case A2A_INT8: return "int8";
    case A2A_INT32: return "int32";
    case A2A_INT64: return "int64";
    case A2A_UINT8: return "uint8";
  }
  return "invalid-dtype";
}

inline const char* algo_name(int64_t algo) {
  switch (algo) {
    case A2A_ALGO_LINEAR: return "linear";
    case A2A_ALGO_2DH: return "2dh";
  }
  return "invalid-algo";
}

}  // namespace a2a
