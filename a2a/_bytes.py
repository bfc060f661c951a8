"""What the movement collectives move without computing on it: a torch
tensor or NumPy array of a dtype a2a's kernels do not take (bool, int16,
uint16, uint32, uint64, complex, float8, ...) goes as the bytes of its
elements, an axis of their own after its last, and the result comes back in
its dtype, as torch.distributed's all-to-all and all-gather move any dtype.

    x (..., n) of dtype d   -> bytes (..., n, itemsize(d)) uint8
    the collective on the bytes (rows, counts and axes unchanged)
    result bytes (..., m, itemsize(d)) -> (..., m) of dtype d

The reductions do not take them: adding needs the dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._arrays import DTYPE_CODES, _torch, torch_dtype_named

__all__ = ["bytes_of"]


def bytes_of(x: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """(x's bytes, the function that views a result's bytes in x's dtype) for a
    C-contiguous torch tensor or NumPy array of at least one dimension whose
    dtype a2a does not take; None for anything else (the collective takes it
    as it is, or says why not)."""
    if type(x) is np.ndarray:
        dtype = x.dtype
        if dtype.name in DTYPE_CODES or dtype.kind not in "biufc" or x.ndim == 0 or not x.flags.c_contiguous:
            return None
        return x.view(np.uint8).reshape(*x.shape, dtype.itemsize), lambda r: r.view(dtype).reshape(r.shape[:-1])
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    name, itemsize = torch_dtype_named(x.dtype)
    if (name in DTYPE_CODES or x.layout != torch.strided or x.is_quantized or x.dim() == 0 or not x.is_contiguous()
            or x.is_neg() or x.is_conj()):
        return None
    dtype = x.dtype
    return x.view(torch.uint8).unflatten(-1, (x.shape[-1], itemsize)), lambda r: r.flatten(-2).view(dtype)
