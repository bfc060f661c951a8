"""JAX arrays at the public functions: in through DLPack, out as JAX arrays.

A JAX array on the CPU enters like any DLPack exporter (_arrays.view: a
read-only NumPy view, no copy). A call given one returns JAX arrays:
:func:`returns_jax` wraps the public collectives and MoE kernels, and turns
their NumPy results (and tuples of them) into JAX arrays. JAX arrays are
immutable, so ``out=`` cannot be one (the call's usual out= check rejects
it on every rank, as it rejects any read-only array). Where a result is not
an array (a Routing, an ESIndex, a VPlan, an FP8 pair), it stays as a2a
returns it for NumPy.

A JAX array on a GPU is rejected with the way around (:func:`gpu_array_error`):
a2a runs CUDA work on the stream of the caller's framework, and JAX exposes
none through its Python API. ``torch.from_dlpack(x)`` or
``cupy.from_dlpack(x)`` views it without a copy (DLPack orders JAX's work
before that framework's stream), and ``jax.dlpack.from_dlpack`` brings the
result back.

a2a never imports JAX itself: with JAX not imported, the wrapper costs one
dictionary lookup per call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["gpu_array_error", "is_jax_array", "returns_jax"]


def _jax() -> Any:
    return sys.modules.get("jax")


def is_jax_array(x: Any) -> bool:
    jax = _jax()
    return jax is not None and isinstance(x, jax.Array)


def _platform(x: Any) -> str:
    return next(iter(x.devices())).platform


def gpu_array_error(x: Any, what: str) -> str | None:
    """Why `x` (a JAX array) cannot be read here, or None for a CPU array."""
    platform = _platform(x)
    if platform == "cpu":
        return None
    return (f"{what} is a JAX array on {platform}; a2a takes JAX arrays on the CPU. JAX exposes no CUDA stream "
            "for a2a to run on: view it with torch.from_dlpack(x) or cupy.from_dlpack(x) (no copy), call a2a, "
            "and bring the result back with jax.dlpack.from_dlpack")


def _has_jax(args: tuple, kwargs: dict) -> bool:
    return any(is_jax_array(a) for a in args) or any(is_jax_array(v) for v in kwargs.values())


def _as_jax(result: Any) -> Any:
    if isinstance(result, np.ndarray):
        return _jax().numpy.asarray(result)
    if type(result) is tuple:  # plain tuples (an exchange and its counts); an Fp8Pair stays a pair
        return tuple(_as_jax(r) for r in result)
    return result


def returns_jax(function: Callable) -> Callable:
    """`function`, returning JAX arrays where it was given one."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        if _jax() is None or kwargs.get("out") is not None or not _has_jax(args, kwargs):
            return result  # a given out= is the result, as it is for every input
        return _as_jax(result)

    return call
