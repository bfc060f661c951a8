"""FP8 rows with block scales: DeepSeek-V3's and DeepEP's dispatch format.

``quantize_fp8(x, block=128)`` cuts each row of x (..., M) into blocks of
``block`` channels along M (the last one shorter when M is not a multiple)
and stores each block as one float32 scale, amax / MAX, and one float8 code
per channel, fp8(x * MAX / amax) (MAX = 448 for e4m3, 57344 for e5m2; round
to nearest even, saturating; an all-zero block has scale 0).
``dequantize_fp8(q, scales)`` gives fp8_to_float(q) * scale.

The pair ``(q, scales)`` it returns is two views of one buffer of packed rows
(a2a_fp8_packed_layout in a2a.h)::

    row r: [ M codes | 0 .. to 16 | ceil(M / block) float32 scales | 0 .. to 16 ]

so that wherever a pair is taken in place of an array, ``fast_encode`` /
``permute`` (which move its rows) and ``all_to_all`` / ``all_to_all_flex`` /
``all_to_all_v`` (which exchange them) move codes and scales together, in one
kernel and one exchange, and return a pair of the same kind. A pair of
separate arrays is packed first (one copy). q is ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` for torch, uint8 for NumPy and CuPy.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _C
from ._arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    ArrayView,
    _cupy,
    _torch,
    address_of,
    argument_view,
    claim_out,
    empty_like,
    is_cupy_array,
    is_torch_tensor,
    mark_written,
    view,
)
from ._errors import InvalidArgumentError

if TYPE_CHECKING:
    from typing import Self  # Python 3.11

__all__ = ["FP8_DTYPES", "FP8_FORMATS", "Fp8Pair", "dequantize_fp8", "pack_fp8", "quantize_fp8", "unpack_fp8"]

# a2a_fp8_format_t codes, and the torch dtype of each.
FP8_FORMATS = {"e4m3": 0, "e5m2": 1}
_TORCH_NAMES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# A dispatch dtype's name (torch's) -> its format: what layers and buffers take as dispatch_dtype.
FP8_DTYPES = {name: fmt for fmt, name in _TORCH_NAMES.items()}
# Channels per scale unless said otherwise (DeepSeek-V3's 1 x 128 tiles).
FP8_BLOCK_DEFAULT = 128
_MAX_BLOCK = 2**62  # the core's int64 block, with room


class Fp8Pair(tuple):
    """(q, scales): the two views of one buffer of packed rows, as
    quantize_fp8, unpack_fp8, fast_encode / permute and the exchanges return
    them. A plain tuple everywhere; ``packed`` is the buffer, so that the next
    exchange or encode of the pair takes it as it is (a plain tuple of
    arrays is checked and, when its arrays are apart, packed first).

    ``Fp8Pair(q, scales, packed)`` checks that q and scales are the two views
    of ``packed`` (the calls trust a pair's buffer). A copy or a pickle holds
    the buffer, and its q and scales are views of the copied buffer again."""

    def __new__(cls, q: Any, scales: Any, packed: Any) -> Self:
        op = "Fp8Pair(q, scales, packed)"
        viewed = _packed(q, scales, op, copy=False, what="(q, scales)")
        given, mine = argument_view(packed, "packed", op), view(viewed, "the rows q and scales view")
        if not (given.same_place(mine) and given.dtype_name == "uint8" and tuple(given.shape) == tuple(mine.shape)
                and given.address == mine.address and _strides_bytes(packed) == _strides_bytes(viewed)):
            _fail(op, f"packed ({given.describe()}) is not the buffer that q and scales view: packed rows "
                      f"{tuple(mine.shape)} of uint8 at q's address")
        return cls._of(q, scales, packed)

    @classmethod
    def _of(cls, q: Any, scales: Any, packed: Any) -> Self:
        """The pair of views that a2a made of `packed` itself (unchecked)."""
        pair = tuple.__new__(cls, (q, scales))
        pair.packed = packed
        return pair

    def __reduce__(self) -> tuple:  # copy / pickle: the buffer, viewed again on the other side
        q, scales = self
        return (unpack_views, (self.packed, q.shape[-1], scales.shape[-1], format_of_codes(q)))


def _fail(op: str, message: str):
    raise InvalidArgumentError(f"{op}: {message}")


def _round_up_16(n: int) -> int:
    return (n + 15) // 16 * 16


def packed_layout(model_dim: int, blocks: int) -> tuple[int, int]:
    """(scale_offset, row_bytes) of packed rows of model_dim codes and
    `blocks` scales, as a2a_fp8_packed_layout computes them."""
    scale_offset = _round_up_16(model_dim)
    return scale_offset, scale_offset + _round_up_16(4 * blocks)


def _format_of(q: Any, format: str | None, op: str) -> str:
    """The format of codes q: its torch dtype's, else `format` (default e4m3)."""
    if format is not None and format not in FP8_FORMATS:
        _fail(op, f"format must be one of {', '.join(FP8_FORMATS)}; got {format!r}")
    if is_torch_tensor(q):
        name = str(q.dtype).removeprefix("torch.")
        mine = next((f for f, n in _TORCH_NAMES.items() if n == name), None)
        if mine is None and name != "uint8":
            _fail(op, f"q is a torch tensor of dtype {name}; expected float8_e4m3fn, float8_e5m2 or uint8")
        if mine is not None and format is not None and format != mine:
            _fail(op, f"format {format!r} disagrees with q's dtype {name}")
        return mine or format or "e4m3"
    return format or "e4m3"


# --- Strided views: the core takes an address and a row stride.


def _strides_bytes(a: Any) -> tuple[int, ...]:
    if is_torch_tensor(a):
        return tuple(s * a.element_size() for s in a.stride())
    return tuple(a.strides)


def _rows_of(a: Any, v: ArrayView, what: str, op: str) -> tuple[int, int]:
    """(rows, row stride in bytes) of an array (..., D) whose last axis is
    contiguous and whose leading axes step through rows of one stride."""
    shape, strides = v.shape, _strides_bytes(a)
    if len(shape) == 0:
        _fail(op, f"{what} ({v.describe()}) has no axis")
    rows = math.prod(shape[:-1])
    if shape[-1] > 1 and strides[-1] != v.itemsize:
        _fail(op, f"{what} ({v.describe()}) is not contiguous along its last axis")
    row_stride = strides[-2] if len(shape) > 1 else shape[-1] * v.itemsize
    step = row_stride
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
        if size > 1 and stride != step:
            _fail(op, f"{what} ({v.describe()}) does not step through its rows with one stride; "
                      "pass a contiguous array")
        step *= size
    return rows, row_stride


def _bytes_view(a: Any) -> Any:
    """Codes as bytes (torch float8 -> uint8), the same memory."""
    if is_torch_tensor(a) and a.dtype != _torch().uint8:
        return a.view(_torch().uint8)
    return a


def _strided(base: Any, offset: int, lead: tuple[int, ...], row_strides: tuple[int, ...], width: int,
             dtype: str) -> Any:
    """A view (*lead, width) of `dtype` whose rows start at byte `offset` of
    base's memory and step by row_strides (bytes), in base's framework (it
    keeps base alive). base is uint8 and starts where the rows do."""
    itemsize = 4 if dtype == "float32" else 1
    shape, strides = (*lead, width * itemsize), (*row_strides, 1)
    if is_torch_tensor(base):
        rows = _torch().as_strided(base, shape, strides, base.storage_offset() + offset)
        return rows.view(getattr(_torch(), dtype))
    if is_cupy_array(base):
        return _cupy().ndarray((*lead, width), dtype=dtype, memptr=base.data + offset,
                               strides=(*row_strides, itemsize))
    start = base if offset == 0 else base.reshape(-1)[offset:]  # offset > 0 only on a contiguous base
    return np.lib.stride_tricks.as_strided(start, shape, strides).view(dtype)


def _row_strides(lead: tuple[int, ...], row_bytes: int) -> tuple[int, ...]:
    """Byte strides of the leading axes of compact packed rows."""
    return tuple(row_bytes * math.prod(lead[i + 1:]) for i in range(len(lead)))


def _views(packed: Any, lead: tuple[int, ...], model_dim: int, blocks: int, codes_dtype: str) -> tuple[Any, Any]:
    """The (q, scales) views of compact packed rows (*lead, row_bytes)."""
    scale_offset, row_bytes = packed_layout(model_dim, blocks)
    strides = _row_strides(lead, row_bytes)
    return (_strided(packed, 0, lead, strides, model_dim, codes_dtype),
            _strided(packed, scale_offset, lead, strides, blocks, "float32"))


def unpack_fp8(packed: Any, model_dim: int, *, block: int = FP8_BLOCK_DEFAULT, format: str = "e4m3") -> tuple[Any, Any]:
    """(q, scales) views of packed rows (..., row_bytes) of uint8: q (..., M)
    (torch float8 of `format`, else uint8), scales (..., ceil(M / block))
    float32."""
    op = "unpack_fp8"
    if format not in FP8_FORMATS:
        _fail(op, f"format must be one of {', '.join(FP8_FORMATS)}; got {format!r}")
    blocks = _blocks(model_dim, block, op)
    p = argument_view(packed, "packed", op)
    row_bytes = packed_layout(model_dim, blocks)[1]
    if p.dtype_name != "uint8" or not p.shape or p.shape[-1] != row_bytes:
        _fail(op, f"packed must be (..., {row_bytes}) of uint8 for M = {model_dim}, block = {block}; "
                  f"got {p.describe()}")
    if p.address % 4 != 0:
        _fail(op, f"packed ({p.describe()}) must start at a 4-byte aligned address: its scales are float32")
    return unpack_views(packed, model_dim, blocks, format)


def unpack_views(packed: Any, model_dim: int, blocks: int, format: str) -> tuple[Any, Any]:
    """The (q, scales) views of compact packed rows (..., row_bytes) of
    model_dim codes and `blocks` scales (codes of torch's float8 dtype of
    `format` for torch)."""
    codes_dtype = _TORCH_NAMES[format] if is_torch_tensor(packed) else "uint8"
    return Fp8Pair._of(*_views(packed, tuple(packed.shape[:-1]), model_dim, blocks, codes_dtype), packed)


def format_of_codes(q: Any) -> str:
    """The format of codes q as its dtype says it (torch float8), else e4m3."""
    return _format_of(q, None, "format_of_codes")


def _blocks(model_dim: int, block: int, op: str) -> int:
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or not 1 <= block <= _MAX_BLOCK:
        _fail(op, f"block must be an int in [1, 2**62] (channels per scale); got {block!r}")
    block = int(block)
    if not isinstance(model_dim, int) or model_dim < 0:
        _fail(op, f"model_dim must be an int >= 0; got {model_dim!r}")
    return -(-model_dim // block)


def is_fp8_pair(x: Any) -> bool:
    """Whether x is a (q, scales) pair rather than one array."""
    return isinstance(x, tuple)


def _pair_views(pair: Any, op: str) -> tuple[ArrayView, ArrayView]:
    """The views of a (q, scales) pair, checked against each other."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        _fail(op, f"an FP8 pair is a tuple (q, scales); got {type(pair).__name__} of length "
                  f"{len(pair) if isinstance(pair, tuple) else 'n/a'}")
    q, scales = pair
    try:
        qv, sv = view(_bytes_view(q), "q"), view(scales, "scales")
    except (TypeError, InvalidArgumentError) as error:
        _fail(op, str(error))
    if qv.dtype_name != "uint8":
        _fail(op, f"q ({qv.describe()}) must be float8 (torch) or uint8")
    if sv.dtype_name != "float32":
        _fail(op, f"scales ({sv.describe()}) must be float32")
    if not qv.same_place(sv):
        _fail(op, f"q ({qv.describe()}) and scales ({sv.describe()}) are not in the same framework and device")
    if len(qv.shape) == 0 or qv.shape[:-1] != sv.shape[:-1]:
        _fail(op, f"q {qv.shape} and scales {sv.shape} must share their leading axes (one row of scales per row)")
    return qv, sv


def pack_fp8(q: Any, scales: Any) -> Any:
    """The packed rows (..., row_bytes) of uint8 holding (q, scales): their
    own buffer when they are the two views of one (as quantize_fp8 returns
    them; no copy), else a new packed copy."""
    return _packed(q, scales, "pack_fp8")


def packed_rows(pair: Any, op: str) -> Any:
    """The packed rows of a pair taken as input: an Fp8Pair's own buffer, or
    a checked tuple's (packed first when its arrays are apart)."""
    if type(pair) is Fp8Pair:
        return pair.packed
    if len(pair) != 2:
        _fail(op, f"an FP8 pair is a tuple (q, scales); got a tuple of {len(pair)}")
    return _packed(*pair, op)


def packed_rows_of(pair: Any, what: str, op: str) -> Any:
    """The packed rows that a pair views (an output to write into): the pair
    must be the two views of one buffer of packed rows, as quantize_fp8 and
    the exchanges return them."""
    if type(pair) is Fp8Pair:
        return pair.packed
    if not isinstance(pair, tuple) or len(pair) != 2:
        _fail(op, f"{what} of an FP8 exchange is a pair (q, scales); got {type(pair).__name__}")
    return _packed(*pair, op, copy=False, what=what)


def _packed(q: Any, scales: Any, op: str, copy: bool = True, what: str = "the pair") -> Any:
    qv, sv = _pair_views((q, scales), op)
    model_dim, blocks = qv.shape[-1], sv.shape[-1]
    scale_offset, row_bytes = packed_layout(model_dim, blocks)
    lead = tuple(qv.shape[:-1])
    q_rows, q_stride = _rows_of(_bytes_view(q), qv, "q", op)
    _, s_stride = _rows_of(scales, sv, "scales", op)
    if q_rows == 0 or (q_stride == s_stride == row_bytes and sv.address == qv.address + scale_offset):
        return _strided(_bytes_view(q), 0, lead, _row_strides(lead, row_bytes), row_bytes, "uint8")
    if not copy:
        _fail(op, f"{what} must be the two views of one buffer of packed rows (as quantize_fp8 and the exchanges "
                  "return them), to be written in place")
    with qv.device_guard():
        packed = empty_like(qv, (*lead, row_bytes), "uint8")
        packed[...] = 0
        codes, packed_scales = _views(packed, lead, model_dim, blocks, "uint8")
        codes[...] = _bytes_view(q)
        packed_scales[...] = scales
    return packed


def quantize_fp8(x: Any, block: int = FP8_BLOCK_DEFAULT, *, format: str = "e4m3", out: Any = None) -> tuple[Any, Any]:
    """x (..., M) of float32, float64, float16 or bfloat16 (C-contiguous) ->
    (q, scales): q (..., M) float8 codes (torch.float8_e4m3fn /
    torch.float8_e5m2; uint8 for NumPy and CuPy), scales (..., ceil(M /
    block)) float32, the two views of one buffer of packed rows (module
    docstring). Runs on x's device (the current stream on CUDA). ``out``: a
    pair of that shape and format to write into (and return), as an earlier
    quantize_fp8 or exchange returned it."""
    op = "quantize_fp8"
    if format not in FP8_FORMATS:
        _fail(op, f"format must be one of {', '.join(FP8_FORMATS)}; got {format!r}")
    a = argument_view(x, "x", op)
    if a.dtype_name not in FLOAT_DTYPES or len(a.shape) == 0:
        _fail(op, f"x must be (..., M) of {', '.join(FLOAT_DTYPES)}; got {a.describe()}")
    model_dim = a.shape[-1]
    blocks = _blocks(model_dim, block, op)
    scale_offset, row_bytes = packed_layout(model_dim, blocks)
    lead = tuple(a.shape[:-1])
    with a.device_guard():
        if out is None:
            packed = empty_like(a, (*lead, row_bytes), "uint8")
            if scale_offset != model_dim or row_bytes - scale_offset != 4 * blocks:
                packed[...] = 0  # the padding travels with the rows: make it zeros, not stale memory
            pair = unpack_views(packed, model_dim, blocks, format)
        else:
            packed, pair = _checked_pair_out(out, a, (*lead, row_bytes), blocks, format, op)
        rows = (math.prod(lead), model_dim, block, FP8_FORMATS[format], address_of(packed), row_bytes,
                address_of(packed) + scale_offset, row_bytes // 4)
        _C.quantize_fp8(a.execution(), a.address, a.dtype_code, rows)
    return pair


def dequantize_fp8(q: Any, scales: Any, *, block: int = FP8_BLOCK_DEFAULT, dtype: str = "float32", format: str | None = None,
                   out: Any = None) -> Any:
    """(q, scales) -> y (..., M) of dtype: fp8_to_float(q) * scale, rounded
    once to dtype. q and scales may be separate arrays or the views of packed
    rows; `block` must be the one they were quantized with. The format is q's
    torch dtype's, else ``format`` (default e4m3)."""
    op = "dequantize_fp8"
    fmt = _format_of(q, format, op)
    qv, sv = _pair_views((q, scales), op)
    model_dim, blocks = qv.shape[-1], sv.shape[-1]
    if _blocks(model_dim, block, op) != blocks:
        _fail(op, f"scales have {blocks} blocks per row; M = {model_dim} with block = {block} has "
                  f"{_blocks(model_dim, block, op)}")
    if dtype not in FLOAT_DTYPES:
        _fail(op, f"dtype must be one of {', '.join(FLOAT_DTYPES)}; got {dtype!r}")
    rows, q_stride = _rows_of(_bytes_view(q), qv, "q", op)
    _, s_stride = _rows_of(scales, sv, "scales", op)
    if s_stride % 4:
        _fail(op, f"scales ({sv.describe()}) rows are not 4-byte aligned")
    shape = tuple(qv.shape)
    if out is None and dtype == "bfloat16" and qv.framework != "torch":
        try:
            np.dtype("bfloat16")
        except TypeError:
            _fail(op, f"NumPy has no bfloat16 without ml_dtypes (import ml_dtypes), and {qv.framework} arrays "
                      "need it for a bfloat16 result; pass out= or use torch tensors")
    with qv.device_guard():
        y = empty_like(qv, shape, dtype) if out is None else _checked_out(out, qv, shape, dtype, op)
        native = (rows, model_dim, block, FP8_FORMATS[fmt], qv.address, q_stride, sv.address, s_stride // 4)
        _C.dequantize_fp8(qv.execution(), native, DTYPE_CODES[dtype], address_of(y))
    return y


def _checked_pair_out(out: Any, like: ArrayView, shape: tuple[int, ...], blocks: int, format: str,
                      op: str) -> tuple[Any, Fp8Pair]:
    """(packed rows, pair) of quantize_fp8's out=: packed views of x's rows."""
    packed = packed_rows_of(out, "out", op)
    p = view(packed, "out")
    if not p.same_place(like) or tuple(p.shape) != shape or out[1].shape[-1] != blocks:
        _fail(op, f"out must be a pair over packed rows {shape} beside x ({like.describe()}); got {p.describe()}")
    if not p.writeable:
        _fail(op, f"out is a pair over read-only packed rows ({p.describe()})")
    if is_torch_tensor(out[0]) and _format_of(out[0], None, op) != format:
        _fail(op, f"out's codes are {out[0].dtype}, not the {format} asked for")
    mark_written(packed)  # the codes and scales are its views: they share its version counter
    return packed, out if type(out) is Fp8Pair else Fp8Pair._of(out[0], out[1], packed)


def _checked_out(out: Any, like: ArrayView, shape: tuple[int, ...], dtype: str, op: str) -> Any:
    o = argument_view(out, "out", op)
    if not o.same_place(like) or o.shape != shape or o.dtype_name != dtype or not o.writeable:
        _fail(op, f"out is a {o.describe()}; expected a writeable {like.framework} array on {like.device_text} "
                  f"of shape {shape} and dtype {dtype}")
    recorded = claim_out(out)
    if recorded is not None:
        _fail(op, recorded)
    return out
