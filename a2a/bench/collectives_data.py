"""What one row of the collectives sweep moves and how it is checked: the
datatypes as nccl-tests names them, the sizes of the sweep, the bandwidths,
the values every rank sends (computed, never exchanged) and the buffers that
hold them (NumPy, or torch for bfloat16 and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DTYPES", "Arrays", "DType", "bandwidths", "block_values", "expected_value", "flex_shape",
           "per_peer_count", "resolve_dtypes", "sweep_sizes"]


@dataclass(frozen=True)
class DType:
    """A datatype as nccl-tests names it, and how the benchmark fills it."""

    name: str  # nccl-tests' name, printed in the `type` column
    storage: str  # NumPy dtype name; "bfloat16" lives in torch tensors
    itemsize: int
    # Values are integers in [0, modulus), exact in the dtype; `modulus`
    # itself is the poison written before a validation call.
    modulus: int
    mpi_type: str  # mpi4py datatype moving the same bytes

    @property
    def needs_torch(self) -> bool:
        return self.storage == "bfloat16"

    @property
    def fill_storage(self) -> str:
        """The NumPy dtype that carries fill values into a torch tensor."""
        return "float32" if self.needs_torch else self.storage


BIG_PRIME = 16_777_213  # largest prime below 2**24: exact in float32
DTYPES = {
    d.name: d
    for d in (
        DType("int8", "int8", 1, 127, "INT8_T"),
        DType("uint8", "uint8", 1, 251, "UINT8_T"),
        DType("int32", "int32", 4, BIG_PRIME, "INT32_T"),
        DType("int64", "int64", 8, BIG_PRIME, "INT64_T"),
        DType("half", "float16", 2, 2039, "INT16_T"),  # integers up to 2048 are exact
        DType("float", "float32", 4, BIG_PRIME, "FLOAT"),
        DType("double", "float64", 8, BIG_PRIME, "DOUBLE"),
        DType("bfloat16", "bfloat16", 2, 251, "INT16_T"),  # integers up to 256 are exact
    )
}
_DTYPE_ALIASES = {
    "char": "int8",
    "int": "int32",
    "float16": "half",
    "fp16": "half",
    "float32": "float",
    "fp32": "float",
    "float64": "double",
    "fp64": "double",
    "bf16": "bfloat16",
}
_UNSUPPORTED_DTYPES = ("uint32", "uint64", "fp8_e4m3", "fp8_e5m2")


def resolve_dtypes(text: str, *, have_torch: bool) -> list[DType]:
    """The datatypes named by -d (a name, an alias, or "all"). Raises ValueError."""
    key = text.strip().lower()
    if key == "all":
        return [d for d in DTYPES.values() if have_torch or not d.needs_torch]
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        hint = " (a2a does not support it)" if key in _UNSUPPORTED_DTYPES else ""
        raise ValueError(f"unknown datatype {text!r}{hint}; expected one of {', '.join(DTYPES)} or all")
    dtype = DTYPES[key]
    if dtype.needs_torch and not have_torch:
        raise ValueError(
            "-d bfloat16 needs torch (NumPy has no bfloat16; a2a takes bfloat16 torch tensors): pip install torch"
        )
    return [dtype]


def sweep_sizes(minbytes: int, maxbytes: int, stepfactor: float = 1, stepbytes: int = 1 << 20) -> list[int]:
    """Requested sizes, as nccl-tests' loop: multiply by stepfactor when it is
    above 1, else add stepbytes, from minbytes while not above maxbytes."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor > 1 and minbytes == 0 and maxbytes > 0:
        raise ValueError("minbytes must be positive with a step factor above 1")
    if stepfactor <= 1 and stepbytes <= 0 and maxbytes > minbytes:
        raise ValueError("stepbytes must be positive when the step factor is 1")
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = int(size * stepfactor) if stepfactor > 1 else size + stepbytes
        if nxt <= size:  # minbytes == maxbytes == 0, or a factor too small to move an integer
            if size == maxbytes:
                break
            nxt = size + 1
        size = nxt
    return sizes


def per_peer_count(nbytes: int, nranks: int, itemsize: int) -> int:
    """Elements sent to each peer for a requested per-rank size (rounded down)."""
    return nbytes // itemsize // nranks


def bandwidths(nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes): algbw = bytes / time, busbw = algbw * (n - 1) / n."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = nbytes / 1.0e9 / seconds
    return algbw, algbw * (nranks - 1) / nranks


def flex_shape(count: int, nranks: int, experts_per_rank: int, hidden: int) -> tuple[int, int, int]:
    """(E, C, M) for all_to_all_flex dispatch holding at most nranks * count
    elements: E = nranks * experts_per_rank experts, M = hidden (less when
    the size is small), C = the capacity that fills the rest."""
    experts = nranks * experts_per_rank
    per_expert = count // experts_per_rank
    m = max(1, min(hidden, per_expert))
    return experts, per_expert // m, m


def expected_value(src: int, dst: int, index: int, modulus: int) -> int:
    """Element `index` of the block rank `src` sends to rank `dst` (pure Python reference).

    The slope 2*src+1 differs between sources, so a block from the wrong
    rank, or shifted, does not match; values stay below `modulus`, so they
    are exact in every dtype."""
    return (index * (2 * src + 1) + 7 * src + 3 * dst) % modulus


def block_values(src: int, dst: int, n: int, modulus: int, start: int = 0) -> np.ndarray:
    """expected_value for indices [start, start + n), as an int64 array."""
    index = np.arange(start, start + n, dtype=np.int64)
    return (index * (2 * src + 1) + (7 * src + 3 * dst)) % modulus


class Arrays:
    """Creates, fills and reads buffers of one DType."""

    def __init__(self, dtype: DType, device: str = "cpu"):
        self.dtype = dtype
        self.device = device
        if dtype.needs_torch or device == "cuda":  # CUDA buffers are torch tensors
            import torch

            self._torch = torch
        else:
            self._torch = None
            self._np_dtype = np.dtype(dtype.storage)

    def empty(self, shape: tuple[int, ...]) -> Any:
        if self._torch is not None:
            return self._torch.empty(shape, dtype=getattr(self._torch, self.dtype.storage), device=self.device)
        return np.empty(shape, dtype=self._np_dtype)

    def fill_blocks(self, out: Any, blocks: list[tuple[int, int, int]]) -> None:
        """Writes block_values(src, dst, n) for each (src, dst, n), one after the other, into flat `out`."""
        flat = out.reshape(-1)
        offset = 0
        for src, dst, n in blocks:
            values = block_values(src, dst, n, self.dtype.modulus)
            if self._torch is not None:
                flat[offset : offset + n] = self._torch.from_numpy(values.astype(self.dtype.fill_storage))
            else:
                flat[offset : offset + n] = values
            offset += n

    def poison(self, out: Any) -> None:
        if self._torch is not None:
            out.fill_(float(self.dtype.modulus))
        else:
            out.fill(self.dtype.modulus)

    def comparable(self, x: Any) -> np.ndarray:
        """A NumPy array whose values compare equal to block_values where x is right."""
        if self._torch is not None:
            x = x.cpu()
            return x.float().numpy() if self.dtype.needs_torch else x.numpy()
        return x

    def raw(self, x: Any) -> np.ndarray:
        """NumPy view of the bytes of x (for mpi4py)."""
        if self._torch is not None:
            return x.view(self._torch.int16).numpy()
        return x

    def tensor(self, x: Any) -> Any:
        """A torch tensor sharing x's memory (for torch.distributed)."""
        import torch

        return x if torch.is_tensor(x) else torch.from_numpy(x)

    def swap_first_axes(self, x: Any) -> Any:
        """A C-contiguous copy of x with its first two axes swapped."""
        if self._torch is not None:
            return x.transpose(0, 1).contiguous()
        return np.ascontiguousarray(x.swapaxes(0, 1))

    def synchronize(self) -> None:
        """Waits for the GPU (CUDA calls return before the data moved)."""
        if self.device == "cuda":
            self._torch.cuda.synchronize()
