"""The experts' FFN on rows grouped by expert as grouped GEMMs (``torch._grouped_mm``).

rows (R, M), expert e's rows at [offsets[e], offsets[e + 1]), offsets[0] = 0
and offsets[n] = R; fc1, fc2 (n, H, M). One grouped GEMM multiplies every
expert's rows by its own matrix::

    forward    hidden = rows x fc1^T            (R, M) . (n, M, H) -> (R, H)
               out    = act(hidden) x fc2        (R, H) . (n, H, M) -> (R, M)
    backward   grad_act = grad_out x fc2^T       (R, M) . (n, M, H) -> (R, H)
               grad_fc2 = act^T x grad_out       (H, R) . (R, M) grouped along R -> (n, H, M)
               grad_fc1 = grad_pre^T x rows      (H, R) . (R, M) grouped along R -> (n, H, M)
               grad_rows = grad_pre x fc1        (R, H) . (n, H, M) -> (R, M)

An expert without rows gets zero weight gradients. The biases go by the
row's expert (a search of the experts' ends, sized by R: no read), and
their gradients are segment sums over the rows.

torch's grouped GEMM takes bfloat16 and float16 (and float32 on the CPU:
on a GPU it may take TF32 whatever torch's setting) with every stride a
multiple of 16 bytes, on the CPU and on the GPUs its kernels support
(sm_90 among them); :func:`grouped_gemms_run` asks torch once per device and dtype
with a tiny call, and says None where it does not run, for the caller's loop
over the experts. The bias gradients are summed in float32, as torch.sum
sums half precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..common.host_values import uploaded
from .activation import Activation, activate, activation_backward

__all__ = ["GroupedRows", "grouped_gemms_run", "grouped_gemms_take", "grouped_rows", "grouped_rows_on_device"]

# float32 on the CPU only: on a GPU torch's float32 grouped GEMM may take TF32 whatever
# torch.backends.cuda.matmul.allow_tf32 says, where the loop's mm follows it.
_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16, torch.float16)}
_RUNS: dict[tuple[str, int | None, torch.dtype], bool] = {}  # (device type, index, dtype) -> torch's grouped GEMM runs


def grouped_gemms_run(device: torch.device, dtype: torch.dtype, model_dim: int, hidden: int) -> bool:
    """Whether torch's grouped GEMM takes rows of `model_dim` and experts of
    `hidden` units in `dtype` on `device` (see the module docstring)."""
    item = dtype.itemsize
    return (dtype in _DTYPES.get(device.type, ()) and (model_dim * item) % 16 == 0 and (hidden * item) % 16 == 0
            and _runs(device, dtype))


def grouped_gemms_take(rows: torch.Tensor, hidden: int, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes `rows` (R > 0, M) with experts of
    `hidden` units whose weights are `weights` (fc1 and fc2 (n, H, M)), whatever
    the groups: one dtype, contiguous, and grouped_gemms_run."""
    num_rows, model_dim = rows.shape
    return (num_rows > 0 and rows.is_contiguous()
            and all(w.dtype == rows.dtype and w.is_contiguous() for w in weights)
            and grouped_gemms_run(rows.device, rows.dtype, model_dim, hidden))


def grouped_rows(rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                 offsets: Sequence[int]) -> GroupedRows | None:
    """The grouped GEMMs of `rows` by `offsets` (n + 1 host integers) with
    the weights fc1 and fc2 (n, H, M), or None where torch's grouped GEMM
    does not take them (see the module docstring)."""
    num_rows = rows.shape[0]
    if offsets[0] != 0 or offsets[-1] != num_rows or not grouped_gemms_take(rows, fc1.shape[1], fc1, fc2):
        return None
    bounds = uploaded(torch.tensor(offsets, dtype=torch.int32), rows.device)
    has_empty = any(offsets[e] == offsets[e + 1] for e in range(len(offsets) - 1))
    return GroupedRows(bounds[1:], bounds.diff(), num_rows, has_empty)


def grouped_rows_on_device(rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                           offsets: torch.Tensor) -> GroupedRows | None:
    """:func:`grouped_rows` by `offsets` on the rows' device ((n + 1,) int64,
    offsets[n] = R: a2a.permute(..., wait=False)'s), read by nothing on the
    host: every expert may be empty, so the backward zeroes the weight
    gradients of those without rows on the device."""
    if not grouped_gemms_take(rows, fc1.shape[1], fc1, fc2):
        return None
    bounds = offsets.to(torch.int32)
    return GroupedRows(bounds[1:], bounds.diff(), rows.shape[0], has_empty=True)


def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs on `device` in `dtype`, in both
    layouts the FFN takes (3-D weights, and grouped along the rows), with an
    expert without rows; asked once."""
    key = (device.type, device.index, dtype)
    if key not in _RUNS and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # The probe copies its offsets to the device, which a capture refuses (and a refusal is no answer).
        raise RuntimeError(f"torch's grouped GEMM is probed at its first use on {device} in {dtype}, which the "
                           "CUDA graph being captured cannot do: run one step eagerly before the capture")
    if key not in _RUNS:
        grouped_mm = getattr(torch, "_grouped_mm", None)
        try:
            a = torch.ones(8, 8, dtype=dtype, device=device)
            b = torch.ones(3, 8, 8, dtype=dtype, device=device)
            ends = torch.tensor([4, 4, 8], dtype=torch.int32, device=device)
            _RUNS[key] = (grouped_mm is not None and grouped_mm(a, b, offs=ends).shape == (8, 8)
                          and grouped_mm(a.t(), a, offs=ends).shape == (3, 8, 8))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # no kernel for this device, dtype or layout
            _RUNS[key] = False
    return _RUNS[key]


@dataclass
class GroupedRows:
    """One call's groups: each expert's last row + 1 (`ends`, int32 on the
    rows' device), its row count (`counts`), and R."""

    ends: torch.Tensor
    counts: torch.Tensor
    num_rows: int
    has_empty: bool  # some expert has no rows
    _expert_of_row: torch.Tensor | None = None

    # (grad rows, grad fc1, grad fc1_bias, grad fc2, grad fc2_bias)
    Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]

    def _per_row(self, bias: torch.Tensor) -> torch.Tensor:
        """(R, width): each row's expert's bias."""
        if self._expert_of_row is None:  # the first expert whose end is past the row (sized by R: no read)
            rows = torch.arange(self.num_rows, dtype=torch.int32, device=self.ends.device)
            self._expert_of_row = torch.searchsorted(self.ends, rows, right=True)
        return bias.index_select(0, self._expert_of_row)

    def _summed(self, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """(n, width): the sum of each expert's rows of `grad`, times `scale`."""
        # In float32: segment_reduce sums in the tensor's own dtype (bfloat16 stops counting at 256).
        summed = torch.segment_reduce(grad.float(), "sum", lengths=self.counts, axis=0, unsafe=True).mul_(scale)
        return summed.to(grad.dtype)

    def ffn(self, rows: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None, fc2: torch.Tensor,
            fc2_bias: torch.Tensor | None, activation: Activation) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (R, M), what the backward keeps of the hidden layer (activation.py))."""
        hidden = torch._grouped_mm(rows, fc1.transpose(1, 2), offs=self.ends)
        if fc1_bias is not None:
            hidden.add_(self._per_row(fc1_bias))
        out = torch._grouped_mm(activate(activation, hidden), fc2, offs=self.ends)
        if fc2_bias is not None:
            out.add_(self._per_row(fc2_bias))
        return out, hidden

    def ffn_backward(self, grad_out: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, fc1: torch.Tensor,
                     fc2: torch.Tensor, activation: Activation, scale: float,
                     with_bias: tuple[bool, bool]) -> Gradients:
        grad_activated = torch._grouped_mm(grad_out, fc2.transpose(1, 2), offs=self.ends)
        activated, grad_pre = activation_backward(activation, hidden, grad_activated)
        grad_fc2 = torch._grouped_mm(activated.t(), grad_out, offs=self.ends)
        grad_fc1 = torch._grouped_mm(grad_pre.t(), rows, offs=self.ends)
        if scale != 1.0:
            grad_fc1.mul_(scale)
            grad_fc2.mul_(scale)
        if self.has_empty:  # zero, whatever a device's grouped GEMM leaves for a group without rows
            gone = (self.counts == 0).view(-1, 1, 1)
            grad_fc1.masked_fill_(gone, 0)
            grad_fc2.masked_fill_(gone, 0)
        grad_fc1_bias = self._summed(grad_pre, scale) if with_bias[0] else None
        grad_fc2_bias = self._summed(grad_out, scale) if with_bias[1] else None
        grad_rows = torch._grouped_mm(grad_pre, fc1, offs=self.ends)
        return grad_rows, grad_fc1, grad_fc1_bias, grad_fc2, grad_fc2_bias
