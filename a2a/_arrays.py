"""Framework-neutral views of array arguments, for the collectives and the
MoE ops alike: NumPy arrays, torch tensors (CPU and CUDA), CuPy arrays
(through DLPack), and anything exporting DLPack or the buffer protocol. The
core receives raw addresses; outputs are allocated with the input's own
framework. Nothing here copies an argument: a non-contiguous array is
reported, never made contiguous behind the caller's back."""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any

import numpy as np

from . import _C
from ._counters import note_allocation
from ._errors import InvalidArgumentError
from ._jax import gpu_array_error, is_jax_array

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
# a2a_device_type_t codes: where a kernel runs (the `exec` tuple of a2a._C).
DEVICE_CPU, DEVICE_CUDA = 0, 1
ACCEPTED_TYPES = (
    "a NumPy array, a torch tensor, a CuPy array, or an object exporting DLPack (__dlpack__) or the buffer protocol"
)
# dtype -> name by lookup: numpy builds dtype.name anew on every access (~3 us).
_NUMPY_NAMES = {np.dtype(name): name for name in DTYPE_CODES if name != "bfloat16"}
# NumPy dtype -> a2a_dtype_t code, for the fast paths that skip ArrayView.
NUMPY_CODES = {dtype: DTYPE_CODES[name] for dtype, name in _NUMPY_NAMES.items()}


_TORCH: Any = None  # torch once the caller has imported it (a lookup in sys.modules costs on every call)
_NO_GUARD = contextlib.nullcontext()


def _torch():
    """torch if the caller already imported it (a2a never imports it itself)."""
    global _TORCH
    if _TORCH is None:
        _TORCH = sys.modules.get("torch")
    return _TORCH


def is_torch_tensor(x: Any) -> bool:
    torch = _TORCH or _torch()
    return torch is not None and isinstance(x, torch.Tensor)


_CPU_EXECUTION = (DEVICE_CPU, 0, 0)


def torch_launch(cuda_device: int | None, kernel: Any, *args: Any) -> Any:
    """kernel(execution, *args) for torch tensors of `cuda_device` (None: host
    memory): the ``(device type, stream, threads)`` that a2a._C takes, torch's
    current stream of that device, made the current device for the call
    where it is not already. On the CPU a plain call (no context to enter:
    each kernel call of a step pays it)."""
    if cuda_device is None:
        return kernel(_CPU_EXECUTION, *args)
    with _torch_guard(cuda_device):
        return kernel((DEVICE_CUDA, _torch_stream(cuda_device), 0), *args)


_RAW_STREAM: Any = None  # torch._C._cuda_getCurrentRawStream (CUDA builds of torch), False where torch lacks it


def _torch_stream(cuda_device: int) -> int:
    """torch's current CUDA stream of a device as a cudaStream_t (an int):
    through torch's raw accessor where it has one, which makes no Stream
    object (microseconds on every kernel call), else current_stream()."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        _RAW_STREAM = getattr(_torch()._C, "_cuda_getCurrentRawStream", False)
    if _RAW_STREAM:
        return _RAW_STREAM(cuda_device)
    return _torch().cuda.current_stream(cuda_device).cuda_stream


def _torch_guard(cuda_device: int) -> Any:
    cuda = _torch().cuda
    return _NO_GUARD if cuda.current_device() == cuda_device else cuda.device(cuda_device)


def records_autograd(*arrays: Any) -> bool:
    """Whether an op on `arrays` records autograd: a torch tensor among them
    requires grad while grad mode is on."""
    torch = _torch()
    return (
        torch is not None
        and any(isinstance(a, torch.Tensor) and a.requires_grad for a in arrays)
        and torch.is_grad_enabled()
    )


def _cupy():
    """cupy if the caller already imported it."""
    return sys.modules.get("cupy")


def is_cupy_array(x: Any) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(x, cupy.ndarray)


class ArrayView:
    """What the core needs to know about one array (built on every call, so
    kept to plain attributes)."""

    __slots__ = (
        "address",
        "contiguous",
        "cuda_device",
        "dtype_name",
        "framework",
        "itemsize",
        "keepalive",
        "obj",
        "shape",
        "writeable",
    )

    def __init__(self, obj, framework, shape, dtype_name, itemsize, address, contiguous, writeable, cuda_device=None):
        self.obj = obj  # the array itself, kept alive for the call
        self.framework = framework  # "numpy", "torch" or "cupy"
        self.shape = shape
        self.dtype_name = dtype_name
        self.itemsize = itemsize
        self.address = address
        self.contiguous = contiguous
        self.writeable = writeable
        self.cuda_device = cuda_device  # CUDA device ordinal, None for host memory
        self.keepalive = None  # a DLPack capsule that owns the memory, for the call

    @property
    def device_text(self) -> str:
        return "cpu" if self.cuda_device is None else f"cuda:{self.cuda_device}"

    def stream(self) -> int:
        """The framework's current CUDA stream on this array's device (a
        cudaStream_t as an int; 0 is the legacy default stream)."""
        if self.framework == "torch":
            return _torch_stream(self.cuda_device)
        if self.framework == "cupy":
            with _cupy().cuda.Device(self.cuda_device):
                return _cupy().cuda.get_current_stream().ptr
        return 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype_name]

    def describe(self) -> str:
        where = "" if self.cuda_device is None else f" on cuda:{self.cuda_device}"
        return f"{self.framework} array of shape {self.shape} and dtype {self.dtype_name}{where}"

    def same_place(self, other: ArrayView) -> bool:
        """Whether `other` is of the same framework and on the same device."""
        return (self.framework, self.cuda_device) == (other.framework, other.cuda_device)

    def execution(self) -> tuple[int, int, int]:
        """(device type, stream, threads) of a kernel on this array: the
        framework's current stream on CUDA, the CPU thread pool otherwise."""
        if self.cuda_device is None:
            return (DEVICE_CPU, 0, 0)
        return (DEVICE_CUDA, self.stream(), 0)

    def device_guard(self) -> Any:
        """A context making this array's CUDA device the current one (for
        kernels and allocations); does nothing for host memory."""
        if self.cuda_device is None:
            return _NO_GUARD
        if self.framework == "cupy":
            return _cupy().cuda.Device(self.cuda_device)
        return _torch_guard(self.cuda_device)


def view(x: Any, what: str) -> ArrayView:
    """Inspects `x` without copying it. Raises TypeError for an object that
    is no array at all, InvalidArgumentError for an array the core cannot
    take (memory that is neither host nor CUDA, a failing export)."""
    if type(x) is not np.ndarray:
        if is_torch_tensor(x):
            return _torch_view(x, what)
        if is_cupy_array(x):
            return _cupy_view(x, what)
        x = _exported_numpy(x, what)
    address, contiguous, writeable = _C.numpy_layout(x)
    # dtype.name is "bfloat16" for ml_dtypes' bfloat16, which NumPy lacks.
    name = _NUMPY_NAMES.get(x.dtype) or _numpy_dtype_name(x.dtype)
    return ArrayView(x, "numpy", x.shape, name, x.itemsize, address, contiguous, writeable)


def _exported_numpy(x: Any, what: str) -> np.ndarray:
    """A NumPy view of an object exporting DLPack (a JAX array on the CPU
    among them: a2a._jax) or the buffer protocol."""
    if is_jax_array(x):
        refused = gpu_array_error(x, what)
        if refused is not None:
            raise InvalidArgumentError(refused)
    if hasattr(x, "__dlpack__"):
        how, export = "DLPack", lambda: np.from_dlpack(x)
    else:
        try:
            buffer = memoryview(x)
        except TypeError:
            raise TypeError(f"{what} of type {type(x).__name__} is not an array; expected {ACCEPTED_TYPES}") from None
        how, export = "the buffer protocol", lambda: np.asarray(buffer)
    try:
        return export()
    except (TypeError, BufferError, RuntimeError, ValueError) as error:
        raise InvalidArgumentError(f"{what} of type {type(x).__name__} cannot be read through {how}: {error}") from None


def _numpy_dtype_name(dtype: np.dtype) -> str:
    """The name checked against DTYPE_CODES; a byte-swapped dtype gets a name
    that is not there, so it is rejected instead of being read as native."""
    if not dtype.isnative:
        return f"{dtype.name} in non-native byte order ({dtype.str})"
    return dtype.name


# torch.dtype -> (name, itemsize): str(dtype) and element_size() cost microseconds on every view.
_TORCH_DTYPES: dict[Any, tuple[str, int]] = {}


def _torch_view(x: Any, what: str) -> ArrayView:
    where = x.device  # a new torch.device on every access: read once
    if where.type == "cpu":
        device = None
    elif where.type == "cuda":
        device = where.index if where.index is not None else _torch().cuda.current_device()
    else:
        raise InvalidArgumentError(f"{what} is a torch tensor on {where}; a2a takes host or CUDA memory")
    if x.is_neg() or x.is_conj():  # a lazy view: its memory holds the values before the negation (conjugation)
        bit, resolve = ("negative", "resolve_neg") if x.is_neg() else ("conjugate", "resolve_conj")
        raise InvalidArgumentError(f"{what} is a torch tensor whose {bit} bit is set (a lazy view, whose memory "
                                   f"holds other values); pass {what}.{resolve}()")
    return ArrayView(x, "torch", tuple(x.shape), *torch_dtype_named(x.dtype), x.data_ptr(), x.is_contiguous(), True,
                     device)


def torch_on(x: Any, cuda_device: int | None) -> bool:
    """Whether torch tensor `x` lives in host memory (`cuda_device` None) or on that CUDA device: the
    placement check of the fast paths, which tell it without a view."""
    return x.is_cpu if cuda_device is None else x.is_cuda and x.get_device() == cuda_device


def torch_dtype_named(dtype: Any) -> tuple[str, int]:
    """(name, itemsize) of a torch.dtype, made once per dtype."""
    named = _TORCH_DTYPES.get(dtype)
    if named is None:
        named = _TORCH_DTYPES[dtype] = (str(dtype).removeprefix("torch."), dtype.itemsize)
    return named


# The floating dtypes the kernels take, by name (data, gates, scores, FP8 sources).
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")

# DLPack (code, bits) -> dtype name.
_DLPACK_DTYPES = {
    (2, 32): "float32",
    (2, 64): "float64",
    (2, 16): "float16",
    (4, 16): "bfloat16",
    (0, 8): "int8",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
}
_DLPACK_CUDA = 2


def _cupy_view(x: Any, what: str) -> ArrayView:
    """A CuPy array through its DLPack capsule: address, shape, dtype and
    device as the exporter states them."""
    cupy = _cupy()
    # CuPy orders the export after work on the current stream of the current
    # device: make that the array's device.
    with cupy.cuda.Device(x.device.id):
        stream = cupy.cuda.get_current_stream().ptr
        try:
            # DLPack: 1 names the legacy default stream (0 is ambiguous).
            capsule = x.__dlpack__(stream=stream if stream != 0 else 1)
        except (TypeError, BufferError, RuntimeError, ValueError) as error:
            raise InvalidArgumentError(f"{what}: the CuPy array cannot be exported through DLPack: {error}") from None
    address, shape, contiguous, code, bits, lanes, device_type, device_id = _C.dlpack_view(capsule)
    if device_type != _DLPACK_CUDA:
        raise InvalidArgumentError(f"{what} is a CuPy array in DLPack device type {device_type}; a2a takes CUDA memory")
    name = _DLPACK_DTYPES.get((code, bits), f"DLPack type code {code} of {bits} bits") if lanes == 1 else "vector"
    v = ArrayView(x, "cupy", tuple(shape), name, max(1, bits // 8), address, contiguous, True, device_id)
    v.keepalive = capsule
    return v


def not_contiguous(v: ArrayView, what: str) -> str:
    """The message for a non-contiguous argument (a2a never copies one)."""
    return f"{what} ({v.describe()}) is not C-contiguous; pass a contiguous array (.contiguous() / np.ascontiguousarray)"


def check_supported(v: ArrayView, what: str) -> str | None:
    """The reason `v` cannot be used as a collective's buffer, or None."""
    if v.dtype_name not in DTYPE_CODES:
        return f"{what} ({v.describe()}) has an unsupported dtype; supported: {SUPPORTED}"
    if not v.contiguous:
        return not_contiguous(v, what)
    return None


def argument_view(x: Any, what: str, op: str) -> ArrayView:
    """The view of one array argument of a local op (the MoE kernels): raises
    TypeError for an object that is no array, InvalidArgumentError for memory
    the core cannot take or a non-contiguous array; messages start with op."""
    try:
        v = view(x, what)
    except TypeError as error:
        raise TypeError(f"{op}: {error}") from None
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{op}: {error}") from None
    if not v.contiguous:
        raise InvalidArgumentError(f"{op}: {not_contiguous(v, what)}")
    return v


def empty_like(v: ArrayView, shape: tuple[int, ...], dtype: str | None = None) -> Any:
    """A new uninitialised array of `shape` in the framework and memory of `v`,
    of v's dtype or the dtype named (e.g. "uint8" for workspaces)."""
    note_allocation()
    if v.framework == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=v.obj.dtype if dtype is None else getattr(torch, dtype), device=v.obj.device)
    numpy_dtype = v.obj.dtype if dtype is None else dtype
    if v.framework == "cupy":
        with v.device_guard():
            return _cupy().empty(shape, dtype=numpy_dtype)
    return np.empty(shape, dtype=numpy_dtype)


def copy_of(x: Any) -> Any:
    """A new C-contiguous copy of a NumPy array, torch tensor or CuPy array,
    in the same framework and memory."""
    if is_torch_tensor(x):
        source = x.detach() if x.requires_grad else x  # (detach is one more op to dispatch)
        return source.clone(memory_format=_torch().contiguous_format)
    if is_cupy_array(x):
        with x.device:  # CuPy allocates on the current device
            return x.copy(order="C")
    return np.array(x, copy=True, order="C")


def shown_copy(table: Any) -> Any:
    """A new copy of a table the kernels trust (a routing's, an index's) for
    the caller; read-only for NumPy, so that writing to it fails instead of
    seeming to change the table (torch and CuPy have no read-only arrays)."""
    shown = copy_of(table)
    if isinstance(shown, np.ndarray):
        shown.flags.writeable = False
    return shown


def address_of(buffer: Any) -> int:
    """The data address of a C-contiguous NumPy array, torch tensor or CuPy array."""
    if is_torch_tensor(buffer):
        return buffer.data_ptr()
    if is_cupy_array(buffer):
        return buffer.data.ptr
    return buffer.ctypes.data


def check_out(out: Any, like: ArrayView, shape: tuple[int, ...], what: str = "out") -> tuple[ArrayView | None, str | None]:
    """Validates a caller-provided output array; returns (view, reason)."""
    try:
        o = view(out, what)
    except (InvalidArgumentError, TypeError) as error:
        return None, str(error)
    reason = check_supported(o, what)
    if reason is None and o.framework != like.framework:
        reason = f"{what} is a {o.framework} array but the input is a {like.framework} array"
    if reason is None and o.cuda_device != like.cuda_device:
        reason = f"{what} is on {o.device_text} but the input is on {like.device_text}"
    if reason is None and (o.shape != shape or o.dtype_name != like.dtype_name):
        reason = f"{what} has shape {o.shape} and dtype {o.dtype_name}; expected shape {shape} and dtype {like.dtype_name}"
    if reason is None and not o.writeable:
        reason = read_only(out, what)
    return o, reason or claim_out(out, what)


def recording_out(out: Any, what: str = "out") -> str | None:
    """Why `out` cannot be written: a torch tensor that requires grad while
    grad mode is on (a2a writes it in place, which autograd cannot record,
    as torch refuses out= of such a tensor); else None."""
    if is_torch_tensor(out) and out.requires_grad and _torch().is_grad_enabled():
        return (f"{what} requires grad; a2a writes it in place, which autograd cannot record (pass a tensor "
                f"that does not, or call it under torch.no_grad())")
    return None


def claim_out(out: Any, what: str = "out") -> str | None:
    """Why `out`, checked otherwise, cannot be written (recording_out); else None, and `out` is marked
    written (mark_written): the last step of every out= check."""
    reason = recording_out(out, what)
    if reason is None:
        mark_written(out)
    return reason


def mark_written(array: Any) -> None:
    """Tells autograd that a2a writes `array`'s memory in place, as torch's own
    in-place ops do: a torch tensor's version counter goes up, so that a
    backward that saved it (or a view of it) refuses to run instead of reading
    what a2a wrote. Nothing for other arrays, nor for inference tensors."""
    if is_torch_tensor(array):
        _torch()._C._increment_version((array,))  # a tuple: a bare tensor takes a path 10x slower


def read_only(out: Any, what: str) -> str:
    """The message for an output that cannot be written."""
    if is_jax_array(out):
        return f"{what} is a JAX array, and JAX arrays are immutable: out= takes NumPy, torch or CuPy arrays"
    return f"{what} is read-only"
