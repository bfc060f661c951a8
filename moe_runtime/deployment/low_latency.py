"""The dropless flow's path for small inference calls (decoding):
``Dropless(low_latency_tokens=N)`` sends a call through
``a2a.LowLatencyBuffer`` when no rank records autograd and every rank has at
most N tokens (both agreed with the call, so every rank takes the same path).

    tokens (T, M), indices (T, k)
    buffer.dispatch   -> expert_x (n, W*N, M): local expert e's rows first,
                         source rank by source rank; counts (n,)
    each expert's FFN on its rows (on the CPU its counted rows; on CUDA all
                         W*N, so that nothing waits for the counts)
    buffer.combine    -> y (T, M) = sum_j g_j * expert output of choice (t, j)

One message to and one from every rank in each direction, the counts inside
them; the dropless flow's results (nothing is dropped), within the rounding
of the matmuls. A buffer per (dtype, top_k) is made on first use, collective
(every rank reaches it in the same call), and kept.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import a2a

from ..experts.activation import Activation
from ..experts.ragged_ffn import ExpertWeights, ffn_rows

__all__ = ["LowLatencyPath"]


class LowLatencyPath:
    """The buffers and the call of the dropless flow's low-latency path."""

    def __init__(self, comm: a2a.Comm, max_tokens: int, num_experts: int, model_dim: int, dispatch_format: str | None):
        self.comm, self.max_tokens, self.num_experts, self.model_dim = comm, max_tokens, num_experts, model_dim
        self.dispatch_dtype = None if dispatch_format is None else {v: k for k, v in a2a.FP8_DTYPES.items()}[dispatch_format]
        self._buffers: dict[tuple[torch.dtype, int], tuple[a2a.LowLatencyBuffer, torch.Tensor, torch.Tensor]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> LowLatencyPath:
        """No buffers: a copy of the layer makes its own on first use, collectively as these were (a
        buffer is this communicator's memory, registered with its peers: it cannot be copied alone)."""
        copied = copy.copy(self)  # the settings, and the communicator, which copies as itself anyway
        copied._buffers = {}
        return copied

    def fits(self, recording_anywhere: bool, token_counts: list[int], prepared: Any) -> bool:
        """Whether a call takes this path (its arguments are agreed: the same on every rank)."""
        return not recording_anywhere and prepared is None and max(token_counts) <= self.max_tokens

    def _buffer(self, dtype: torch.dtype, top_k: int, hidden: int):
        key = (dtype, top_k)
        if key not in self._buffers:
            buffer = a2a.LowLatencyBuffer(self.comm, self.max_tokens, self.model_dim, self.num_experts, top_k,
                                          str(dtype).removeprefix("torch."), dispatch_dtype=self.dispatch_dtype)
            shape = (buffer.local_experts, buffer.expert_capacity)
            with torch.inference_mode(False):  # normal tensors: a call outside inference mode writes them too
                out = torch.zeros((*shape, self.model_dim), dtype=dtype, device=buffer.device)
                scratch = torch.zeros((*shape, hidden), dtype=dtype, device=buffer.device)
            self._buffers[key] = (buffer, out, scratch)
        return self._buffers[key]

    def run(self, tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None, weights: ExpertWeights,
            activation: Activation) -> tuple[torch.Tensor, Any, int | None]:
        """(y, rows each local expert computed (None on CUDA: on the device),
        rows sent to other ranks (None on CUDA))."""
        fc1, fc1_bias, fc2, fc2_bias = weights
        buffer, out, hidden = self._buffer(tokens.dtype, indices.shape[1], fc1.shape[1])
        expert_x, counts = buffer.dispatch(tokens, indices)
        on_host = expert_x.device.type == "cpu"
        rows = counts.tolist() if on_host else [buffer.expert_capacity] * buffer.local_experts
        for e, count in enumerate(rows):
            weights_e = (fc1[e], None if fc1_bias is None else fc1_bias[e], fc2[e], None if fc2_bias is None else fc2_bias[e])
            ffn_rows(expert_x[e], [0, count], [(0, weights_e)], activation, out[e], hidden[e])
        y = buffer.combine(out, None if gates is None else gates.contiguous())
        if not on_host:
            return y, None, None
        destinations = indices // buffer.local_experts
        sent = int(((indices >= 0) & (destinations != self.comm.rank)).sum())  # choices, repeated experts counted
        return y, counts.numpy().copy(), sent
