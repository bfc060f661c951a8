"""Hexa-MoE's pipeline-shared cache (Section 3.3, Figure 4): the one full
copy of the experts that the data-centric layers take turns in.

Each data-centric layer keeps only its shards: a hidden slice of every
expert (moe_runtime.hexa.experts), or Tutel's n whole experts per rank
(moe_runtime.experts.ffn, when the dictionary of an expert-parallel layer picks
the data-centric flow). To compute, it gathers every rank's shards into the
cache (the layout's ``gather_whole``):
one flat buffer per (dtype, device), as large as the largest layer that
registered, reused by every layer in turn. Nothing keeps the gathered
weights for the backward: the backward gathers again (unless the cache still
holds the same layer at the same parameter versions, as for the last layer
of the forward, whose backward comes first). So the memory of the full
experts is one layer's, whatever the depth.

The cache knows which layer it holds. ``prefetch`` starts a layer's gather
on a communication thread (a CUDA side stream on the GPU, moe_runtime.
pipeline.Overlap), so that it runs while the caller computes something else
(the attention before the MoE layer); the layer's forward then waits for it.
Before reusing what it holds, the cache agrees with the other ranks (one
8-byte all-reduce) that every rank's shards are unchanged, so that either
every rank gathers or none does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

import a2a

from ..common.host_values import all_reduce_values
from ..common.overlap import Overlap, check_thread_level

__all__ = ["SHARED_CACHE", "CachedExperts", "GatheredLayout", "PipelineSharedCache", "full_elements", "scatter_gradient"]

CachedExperts = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # fc1_w (E, H, M), fc1_bias (E, H), fc2_w


class GatheredLayout(Protocol):
    """What the cache needs of an expert layout (HiddenShardedExperts, FFNExperts)."""

    num_experts: int
    hidden_size: int
    model_dim: int
    batched_fc1_w: torch.Tensor
    batched_fc1_bias: torch.Tensor | None

    def sharded_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's shards of fc1_w, fc1_bias (or None), fc2_w."""

    def gather_whole(self, shard: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` <- every rank's `shard` of one tensor, whole (collective)."""

    def reduce_scatter_whole(self, whole: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` (a shard) <- its part of the sum over ranks of `whole`."""


def scatter_gradient(whole: torch.Tensor, experts: GatheredLayout, shard: torch.Tensor, comm: a2a.Comm,
                     scale: float) -> torch.Tensor:
    """A shard's gradient from the gradient of its whole tensor on every rank
    (gather_whole's adjoint): its part of the sum over ranks, times `scale`."""
    grad = experts.reduce_scatter_whole(whole.contiguous(), comm, torch.empty_like(shard))
    return grad.mul_(scale) if scale != 1.0 else grad


def full_elements(experts: GatheredLayout) -> int:
    """Elements of a layout's fc1_w, fc2_w and fc1_bias with every expert
    whole: what the cache holds for that layer."""
    per_expert = 2 * experts.hidden_size * experts.model_dim
    if experts.batched_fc1_bias is not None:
        per_expert += experts.hidden_size
    return experts.num_experts * per_expert


def _versions(experts: GatheredLayout) -> tuple:
    """What identifies the current values of a layout's shards: their storage
    and in-place version counters (an optimizer step or a load changes them)."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in experts.sharded_weights() if p is not None)


class PipelineSharedCache:
    """The full experts of one data-centric layer at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._layers: weakref.WeakSet[GatheredLayout] = weakref.WeakSet()  # sized for the largest alive
        self._holder: tuple[int, tuple] | None = None  # (layer token, its shards' versions) gathered
        self._pending: tuple[int, tuple, Callable[[], Any]] | None = None  # a prefetch: (token, versions, wait)
        self._next_token = 0
        self.gathers = 0  # whole gathers made (forward, backward and prefetch), for tests and benchmarks
        self.reuses = 0  # times the cache already held the layer asked for

    # -- sizes -------------------------------------------------------------------
    def register(self, experts: GatheredLayout) -> int:
        """Makes room for `experts` (the buffer grows to the largest layer
        alive at its next use) and returns the layer's token in this cache."""
        self._layers.add(experts)
        self._next_token += 1
        return self._next_token

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's buffers (one per dtype and device in use)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The flat buffer for `dtype` on `device`, None before its first use."""
        return self._buffers.get((dtype, torch.device(device)))

    def clear(self) -> None:
        """Frees the buffers (after waiting for a prefetch in flight)."""
        self._finish_pending()
        self._buffers.clear()
        self._holder = None

    # -- use ----------------------------------------------------------------------
    def acquire(self, token: int, experts: GatheredLayout, comm: a2a.Comm) -> CachedExperts:
        """The whole experts of the layer `token` (collective over `comm`):
        from a prefetch or an earlier gather when every rank's shards are
        unchanged since, else gathered now."""
        versions = _versions(experts)
        self.wait()
        if self._holder is not None and self._holder[0] == token:
            # The same layer on every rank (the calls are collective); its shards may differ.
            same = np.array([1 if self._holder[1] == versions else 0], dtype=np.int64)
            if int(all_reduce_values(same, comm, op="min")[0]) == 1:
                self.reuses += 1
                return self._views(experts)
        return self._gather(token, experts, comm, versions)

    def prefetch(self, token: int, experts: GatheredLayout, comm: a2a.Comm, overlap: Overlap) -> None:
        """Starts gathering the layer `token` into the cache off the caller's
        path (collective over `comm`, which the caller leaves alone until the
        layer's forward). A prefetch still in flight is waited for first."""
        check_thread_level(comm, "prefetch gathers the experts")
        self._finish_pending()
        versions = _versions(experts)
        views = self._views(experts)  # the buffer is (re)made here, on the caller's thread
        self._holder = None  # being overwritten

        def gather() -> None:
            self._fill(experts, comm, views)

        self._pending = (token, versions, overlap.start(gather))

    def wait(self) -> None:
        """Waits for a prefetch in flight (raising its error, if any); the
        cache then holds its layer."""
        pending = self._finish_pending()
        if pending is not None:
            self._holder = (pending[0], pending[1])

    def _finish_pending(self) -> tuple[int, tuple, Callable[[], Any]] | None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[2]()  # raises the gather's error, if any
        return pending

    def _gather(self, token: int, experts: GatheredLayout, comm: a2a.Comm, versions: tuple) -> CachedExperts:
        self._holder = None
        views = self._views(experts)
        self._fill(experts, comm, views)
        self._holder = (token, versions)
        return views

    def _fill(self, experts: GatheredLayout, comm: a2a.Comm, views: CachedExperts) -> None:
        with torch.no_grad():
            for shard, whole in zip(experts.sharded_weights(), views):
                if shard is not None:
                    experts.gather_whole(shard.detach(), comm, whole)
        self.gathers += 1

    def _views(self, experts: GatheredLayout) -> CachedExperts:
        """The layer's (fc1_w, fc1_bias, fc2_w) over the buffer of its dtype and device."""
        fc1 = experts.batched_fc1_w
        key = (fc1.dtype, fc1.device)
        elements = max([full_elements(experts), *(full_elements(layer) for layer in self._layers)])
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < elements:
            self._buffers.pop(key, None)  # the old buffer goes before the new one is made
            with torch.inference_mode(False):  # a normal tensor: a call outside inference mode writes it too
                buffer = torch.empty(elements, dtype=fc1.dtype, device=fc1.device)
            self._buffers[key] = buffer
            self._holder = None
        num_experts, hidden, model_dim = experts.num_experts, experts.hidden_size, experts.model_dim
        weight = num_experts * hidden * model_dim
        fc1_w = buffer[:weight].view(num_experts, hidden, model_dim)
        fc2_w = buffer[weight : 2 * weight].view(num_experts, hidden, model_dim)
        fc1_bias = None
        if experts.batched_fc1_bias is not None:
            fc1_bias = buffer[2 * weight : 2 * weight + num_experts * hidden].view(num_experts, hidden)
        return fc1_w, fc1_bias, fc2_w


# The process's cache: every data-centric layer uses it unless given another.
SHARED_CACHE = PipelineSharedCache()
