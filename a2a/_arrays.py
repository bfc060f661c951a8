"""Framework-neutral views of array arguments: NumPy arrays, torch tensors,
and anything exporting DLPack or the buffer protocol. The core receives raw
addresses; outputs are allocated with the input's own framework."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from . import _C
from ._errors import InvalidArgumentError

# a2a_dtype_t codes of csrc/include/a2a/a2a.h.
DTYPE_CODES = {
    "float32": 0,
    "float64": 1,
    "float16": 2,
    "bfloat16": 3,
    "int8": 4,
    "int32": 5,
    "int64": 6,
    "uint8": 7,
}
SUPPORTED = ", ".join(DTYPE_CODES)
# dtype -> name by lookup: numpy builds dtype.name anew on every access (~3 us).
_NUMPY_NAMES = {np.dtype(name): name for name in DTYPE_CODES if name != "bfloat16"}


def _torch():
    """torch if the caller already imported it (a2a never imports it itself)."""
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


class ArrayView:
    """What the core needs to know about one array (built on every call, so
    kept to plain attributes)."""

    __slots__ = ("address", "contiguous", "dtype_name", "framework", "itemsize", "obj", "shape", "writeable")

    def __init__(self, obj, framework, shape, dtype_name, itemsize, address, contiguous, writeable):
        self.obj = obj  # the array itself, kept alive for the call
        self.framework = framework  # "numpy" or "torch"
        self.shape = shape
        self.dtype_name = dtype_name
        self.itemsize = itemsize
        self.address = address
        self.contiguous = contiguous
        self.writeable = writeable

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype_name]

    def describe(self) -> str:
        return f"{self.framework} array of shape {self.shape} and dtype {self.dtype_name}"


def view(x: Any, what: str) -> ArrayView:
    """Inspects `x` without copying it. Raises InvalidArgumentError for anything
    the core cannot take: unknown objects, non-CPU memory."""
    if type(x) is not np.ndarray:
        if is_torch_tensor(x):
            return _torch_view(x, what)
        try:
            x = np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(memoryview(x))
        except (TypeError, BufferError, RuntimeError, ValueError) as error:
            raise InvalidArgumentError(
                f"{what} of type {type(x).__name__} is neither a NumPy array, a torch tensor, "
                f"a DLPack-capable CPU array nor a buffer: {error}"
            ) from None
    address, contiguous, writeable = _C.numpy_layout(x)
    # dtype.name is "bfloat16" for ml_dtypes' bfloat16, which NumPy lacks.
    name = _NUMPY_NAMES.get(x.dtype) or _numpy_dtype_name(x.dtype)
    return ArrayView(x, "numpy", x.shape, name, x.itemsize, address, contiguous, writeable)


def _numpy_dtype_name(dtype: np.dtype) -> str:
    """The name checked against DTYPE_CODES; a byte-swapped dtype gets a name
    that is not there, so it is rejected instead of being read as native."""
    if not dtype.isnative:
        return f"{dtype.name} in non-native byte order ({dtype.str})"
    return dtype.name


def _torch_view(x: Any, what: str) -> ArrayView:
    if x.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what} is a torch tensor on {x.device}; this communicator moves host memory "
            "(CUDA support is not built into this a2a)"
        )
    name = str(x.dtype).removeprefix("torch.")
    return ArrayView(x, "torch", tuple(x.shape), name, x.element_size(), x.data_ptr(), x.is_contiguous(), True)


def check_supported(v: ArrayView, what: str) -> str | None:
    """The reason `v` cannot be used as a collective's buffer, or None."""
    if v.dtype_name not in DTYPE_CODES:
        return f"{what} ({v.describe()}) has an unsupported dtype; supported: {SUPPORTED}"
    if not v.contiguous:
        return f"{what} ({v.describe()}) is not C-contiguous; pass a contiguous array (e.g. .copy() / .contiguous())"
    return None


def empty_like(v: ArrayView, shape: tuple[int, ...]) -> Any:
    """A new uninitialised array of `shape` with the dtype and framework of `v`."""
    if v.framework == "torch":
        return _torch().empty(shape, dtype=v.obj.dtype, device=v.obj.device)
    return np.empty(shape, dtype=v.obj.dtype)


def check_out(out: Any, like: ArrayView, shape: tuple[int, ...], what: str = "out") -> tuple[ArrayView | None, str | None]:
    """Validates a caller-provided output array; returns (view, reason)."""
    try:
        o = view(out, what)
    except InvalidArgumentError as error:
        return None, str(error)
    reason = check_supported(o, what)
    if reason is None and o.framework != like.framework:
        reason = f"{what} is a {o.framework} array but the input is a {like.framework} array"
    if reason is None and (o.shape != shape or o.dtype_name != like.dtype_name):
        reason = f"{what} has shape {o.shape} and dtype {o.dtype_name}; expected shape {shape} and dtype {like.dtype_name}"
    if reason is None and not o.writeable:
        reason = f"{what} is read-only"
    return o, reason
