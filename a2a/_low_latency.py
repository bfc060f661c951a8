"""The low-latency dispatch and combine (DeepEP's low-latency mode, our own
implementation): an MoE layer's exchange for a handful of tokens per rank,
where a call is a few microseconds of work and what counts is latency.

    buffer = a2a.LowLatencyBuffer(comm, max_tokens_per_rank=128, model_dim=M, num_experts=E, top_k=k,
                                  dtype="bfloat16")                  # collective, buffers allocated once
    expert_x, counts = buffer.dispatch(x, indices)   # (L, W * max_tokens, M), (L,) rows of each local expert
    y = buffer.combine(expert_fn(expert_x), gates)   # (T, M): sum_j gates[t, j] * output of choice (t, j)

Each call sends one message to every rank and receives one from every rank,
the row counts inside them (no count exchange round); the buffers are the
ones allocated at construction (outputs are views of them, valid until the
next call). On CUDA the messages have a fixed size and the counts stay on
the device: a call never waits for the stream, and can be captured into a
CUDA graph; ``check()`` waits and raises what the in-band checks found. With
``dispatch_dtype="float8_e4m3fn"`` the tokens travel as packed FP8 rows
(a2a.quantize_fp8, block 128) and ``expert_x`` holds them dequantized to
``dtype``. docs/moe_kernels.md has the layouts; a2a.h the C API
(``a2a_low_latency_*``).
"""

from __future__ import annotations

import numbers
from typing import Any

from . import _C, _fp8
from ._arrays import DEVICE_CPU, DTYPE_CODES, FLOAT_DTYPES, _torch, mark_written, view
from ._comm import Comm
from ._errors import InvalidArgumentError

__all__ = ["LowLatencyBuffer"]

_HOST = (DEVICE_CPU, 0, 0)  # a2a._C's exec of the CPU kernels


class LowLatencyBuffer:
    """Buffers and a native handle for low-latency dispatch / combine calls on
    ``comm`` (torch tensors on the communicator's device; see the module
    docstring). Collective: every rank constructs it alike."""

    def __init__(self, comm: Comm, max_tokens_per_rank: int, model_dim: int, num_experts: int, top_k: int,
                 dtype: str = "bfloat16", *, dispatch_dtype: str | None = None):
        if not isinstance(comm, Comm):
            raise TypeError(f"LowLatencyBuffer: comm must be an a2a.Comm, got {type(comm).__name__}")
        try:  # this rank's own arguments: a failure here fails the construction on every rank
            torch = _torch()
            if torch is None:
                raise InvalidArgumentError("it takes torch tensors: import torch before constructing it")
            if dtype not in FLOAT_DTYPES:
                raise InvalidArgumentError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}; got {dtype!r}")
            sizes = {"max_tokens_per_rank": max_tokens_per_rank, "model_dim": model_dim, "num_experts": num_experts,
                     "top_k": top_k}
            for name, value in sizes.items():
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise InvalidArgumentError(f"{name} must be an int; got {value!r}")
            self.format = None if dispatch_dtype is None else _fp8_format(dispatch_dtype)
        except InvalidArgumentError as error:
            comm._native.report_invalid("low_latency_create", f"LowLatencyBuffer on rank {comm.rank}: "
                                        f"{str(error).removeprefix('LowLatencyBuffer: ')}")
        self.comm, self.model_dim, self.top_k, self.dtype = comm, int(model_dim), int(top_k), dtype
        self.max_tokens = int(max_tokens_per_rank)
        element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        blocks = -(-self.model_dim // _fp8.FP8_BLOCK_DEFAULT)
        row_bytes = _fp8.packed_layout(self.model_dim, blocks)[1] if self.format else self.model_dim * element
        self._native = _C.LowLatency(comm._native, self.max_tokens, int(num_experts), self.top_k, row_bytes,
                                     self.model_dim, DTYPE_CODES[dtype])
        self.local_experts = int(num_experts) // comm.size
        self.expert_capacity = self._native.expert_capacity
        device = torch.device("cuda", comm.cuda_device) if comm.device == "cuda" else torch.device("cpu")
        self.device = device
        # Normal tensors even when made under torch.inference_mode(): the calls after it, outside that mode,
        # hand out views of them, which the caller may write.
        with torch.inference_mode(False):
            self._workspace = torch.zeros(self._native.workspace_size, dtype=torch.uint8, device=device)
            self._recv = torch.zeros((self.local_experts, self.expert_capacity, row_bytes), dtype=torch.uint8,
                                     device=device)
            self._counts = torch.zeros(self.local_experts, dtype=torch.int64, device=device)
            self._y = torch.zeros((self.max_tokens, self.model_dim), dtype=getattr(torch, dtype), device=device)
            if self.format is None:
                self._expert_x = self._recv.view(getattr(torch, dtype))
                self._sent = None
            else:
                self._expert_x = torch.zeros((self.local_experts, self.expert_capacity, self.model_dim),
                                             dtype=getattr(torch, dtype), device=device)
                self._sent = _fp8.unpack_views(torch.zeros((self.max_tokens, row_bytes), dtype=torch.uint8, device=device),
                                               self.model_dim, blocks, self.format)
        self._blocks = blocks
        self._row_bytes = row_bytes
        self._num_tokens: int | None = None

    def __repr__(self) -> str:
        return (f"a2a.LowLatencyBuffer(max_tokens_per_rank={self.max_tokens}, model_dim={self.model_dim}, "
                f"local_experts={self.local_experts}, top_k={self.top_k}, dtype={self.dtype}, "
                f"dispatch={'fp8 ' + self.format if self.format else self.dtype}, device={self.device})")

    def _exec(self, stream_of: Any) -> tuple[int, int, int]:
        """The kernels' execution, with the comm on the same stream (CUDA)."""
        if self.device.type == "cpu":
            return _HOST
        v = view(stream_of, "x")
        if v.cuda_device is not None:
            stream = v.stream()
            if stream != self.comm._stream:
                self.comm._native.set_stream(stream)
                self.comm._stream = stream
        return v.execution()

    def __reduce__(self):
        raise TypeError("a2a.LowLatencyBuffer cannot be copied or pickled: its memory is registered with its "
                        "communicator's peers; create another on every rank (collective)")

    def _problem(self, x: Any, indices: Any) -> str | None:
        """Why (x, indices) cannot be dispatched, or None."""
        torch = _torch()
        if not (torch.is_tensor(x) and torch.is_tensor(indices)):
            return "x and indices must be torch tensors"
        want = getattr(torch, self.dtype)
        if x.dim() != 2 or x.shape[1] != self.model_dim or x.dtype != want or not x.is_contiguous():
            return (f"x must be a contiguous (T, {self.model_dim}) tensor of {self.dtype}; got {tuple(x.shape)} "
                    f"of {x.dtype}")
        if x.requires_grad and torch.is_grad_enabled():
            return ("x requires grad, and the low-latency dispatch records no autograd (it serves inference): call "
                    "it under torch.no_grad(), or pass x.detach()")
        if x.shape[0] > self.max_tokens:
            return f"x has {x.shape[0]} tokens; this buffer takes up to {self.max_tokens} (max_tokens_per_rank)"
        if (indices.dim() != 2 or tuple(indices.shape) != (x.shape[0], self.top_k) or not indices.is_contiguous()
                or indices.dtype not in (torch.int32, torch.int64)):
            return (f"indices must be a contiguous ({x.shape[0]}, {self.top_k}) tensor of int32 or int64; got "
                    f"{tuple(indices.shape)} of {indices.dtype}")
        if x.device != self.device or indices.device != self.device:
            return f"x ({x.device}) and indices ({indices.device}) must be on the buffer's device, {self.device}"
        return None

    def dispatch(self, x: Any, indices: Any) -> tuple[Any, Any]:
        """x (T, M) of dtype, indices (T, top_k) -> (expert_x (L, W * max_tokens,
        M), counts (L,) int64): local expert e's rows are expert_x[e, :counts[e]],
        source rank by source rank, each source's in token order. Collective."""
        problem = self._problem(x, indices)
        self._num_tokens = None
        if problem is not None:  # the native call still runs, marked: every other rank fails naming this one
            execution = self._exec(self._workspace)
            try:
                self._native.dispatch(execution, self._workspace.data_ptr(), self._workspace.numel(), 0, -1, 0,
                                      DTYPE_CODES["int64"], self._recv.data_ptr(), self._counts.data_ptr())
            except InvalidArgumentError:
                pass
            raise InvalidArgumentError(f"low_latency_dispatch on rank {self.comm.rank} of {self.comm.size}: {problem}")
        tokens = x.shape[0]
        execution = self._exec(x)
        source = x
        if self.format is not None:  # into the buffer's own packed rows (x was checked above)
            source = self._sent.packed
            _C.quantize_fp8(execution, x.data_ptr(), DTYPE_CODES[self.dtype], self._fp8_rows(tokens, source.data_ptr()))
        index_code = DTYPE_CODES[str(indices.dtype).removeprefix("torch.")]
        self._native.dispatch(execution, self._workspace.data_ptr(), self._workspace.numel(), source.data_ptr(),
                              tokens, indices.data_ptr(), index_code, self._recv.data_ptr(), self._counts.data_ptr())
        self._num_tokens = tokens
        if self.format is not None:
            self._dequantize()
        mark_written(self._expert_x)  # the last dispatch's views, if autograd saved them, are stale now
        mark_written(self._counts)
        return self._expert_x, self._counts

    def _dequantize(self) -> None:
        """The arrived FP8 rows into expert_x: on the CPU the counted rows of
        each expert (the counts are on the host), on CUDA all of them (the
        counts stay on the device)."""
        # The buffers are the handle's own: the core's calls directly, without a2a.dequantize_fp8's checks.
        execution, code = self._exec(self._recv), DTYPE_CODES[self.dtype]
        recv, out = self._recv.data_ptr(), self._expert_x.data_ptr()
        rows = self._counts.tolist() if self.device.type == "cpu" else [self.expert_capacity] * self.local_experts
        for e, count in enumerate(rows):
            if count:
                at = e * self.expert_capacity
                _C.dequantize_fp8(execution, self._fp8_rows(count, recv + at * self._row_bytes), code,
                                  out + at * self.model_dim * self._expert_x.element_size())

    def _fp8_rows(self, rows: int, packed: int) -> tuple[int, ...]:
        """a2a_fp8_rows_t of `rows` packed rows at address `packed`."""
        scale_offset = _fp8.packed_layout(self.model_dim, self._blocks)[0]
        return (rows, self.model_dim, _fp8.FP8_BLOCK_DEFAULT, _fp8.FP8_FORMATS[self.format], packed, self._row_bytes,
                packed + scale_offset, self._row_bytes // 4)

    def combine(self, expert_out: Any, gates: Any = None) -> Any:
        """expert_out (L, W * max_tokens, M) of dtype (row i of expert e the
        output for expert_x[e, i]) -> y (T, M) of the last dispatch's tokens:
        sum over j of gates[t, j] * the output of choice (t, j), in j order,
        accumulated in float32 (float64 for float64). gates (T, top_k) of
        float32 or dtype, or None for 1. Collective."""
        torch = _torch()
        tokens = self._num_tokens
        want = (self.local_experts, self.expert_capacity, self.model_dim)
        problem = None
        if tokens is None:
            problem = "no dispatch precedes this combine"
        elif not torch.is_tensor(expert_out) or tuple(expert_out.shape) != want or not expert_out.is_contiguous() \
                or expert_out.dtype != getattr(torch, self.dtype) or expert_out.device != self.device:
            problem = (f"expert_out must be a contiguous {want} tensor of {self.dtype} on {self.device}; got "
                       f"{getattr(expert_out, 'shape', type(expert_out).__name__)}")
        elif gates is not None and (not torch.is_tensor(gates) or tuple(gates.shape) != (tokens, self.top_k)
                                    or not gates.is_contiguous() or gates.device != self.device
                                    or gates.dtype not in (torch.float32, getattr(torch, self.dtype))):
            problem = f"gates must be a contiguous ({tokens}, {self.top_k}) tensor of float32 or {self.dtype}"
        self._num_tokens = None
        if problem is not None:
            try:  # no expert_out: the core rejects, and every other rank fails naming this one
                self._native.combine(self._exec(self._workspace), self._workspace.data_ptr(),
                                     self._workspace.numel(), 0, 0, DTYPE_CODES["float32"], 0)
            except InvalidArgumentError:
                pass
            raise InvalidArgumentError(f"low_latency_combine on rank {self.comm.rank} of {self.comm.size}: {problem}")
        y = self._y[:tokens]
        gate_code = DTYPE_CODES["float32"] if gates is None else DTYPE_CODES[str(gates.dtype).removeprefix("torch.")]
        self._native.combine(self._exec(expert_out), self._workspace.data_ptr(), self._workspace.numel(),
                             expert_out.data_ptr(), 0 if gates is None else gates.data_ptr(), gate_code,
                             y.data_ptr())
        mark_written(self._y)
        return y

    def check(self) -> None:
        """CUDA: waits for the stream and raises what the last calls' in-band
        checks found (a rank that rejected its input, calls out of step, an
        index out of range); on the CPU every call has checked already."""
        self._native.check(self._exec(self._workspace), self._workspace.data_ptr(), self._workspace.numel())


def _fp8_format(dispatch_dtype: Any) -> str:
    name = str(dispatch_dtype).removeprefix("torch.")
    if name not in _fp8.FP8_DTYPES:
        raise InvalidArgumentError(f"LowLatencyBuffer: dispatch_dtype must be None or one of "
                                   f"{sorted(_fp8.FP8_DTYPES)}; got {dispatch_dtype!r}")
    return _fp8.FP8_DTYPES[name]
