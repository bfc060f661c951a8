"""The dropless flow (``MoELayer(flow="dropless")`` or
``flow=Dropless(...)``) and its two caches, as a :class:`moe_runtime.flows.base.Flow`.

Every routed choice reaches its expert (moe_runtime.deployment.dropless):
r = 1, d = 1, whole experts on every rank. ``Dropless.expert_cache`` serves
the calls that record no autograd graph (inference) from the host-resident
experts of moe_runtime.deployment.expert_cache; ``Dropless.assignment_cache``
starts the predicted dispatch of the calls that pass ``sample_ids`` before
the gate (moe_runtime.deployment.cached_dispatch). Both give the same results
as the plain flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..common.agreement import CallFields
from ..common.overlap import check_thread_level
from ..flows.base import Call, Plan, WholeExpertFlow, whole_expert_layer
from .assignment_cache import AssignmentCache
from .cached_dispatch import CachedDispatch
from .dropless import CACHED_WEIGHT_NAMES, dropless_moe
from .expert_cache import ExpertCache
from .low_latency import LowLatencyPath

__all__ = ["Dropless", "DroplessFlow"]


@dataclass(frozen=True)
class Dropless:
    """The dropless flow's settings: ``expert_cache`` (an :class:`ExpertCache`,
    inference), ``assignment_cache`` (an :class:`AssignmentCache`, calls with
    ``sample_ids``); either may be None. ``low_latency_tokens`` N > 0: calls
    that record no autograd on any rank, with at most N tokens on every rank,
    go through a2a.LowLatencyBuffer (deployment/low_latency.py). ``wait``
    False (one rank, no cache, no low-latency path, no FP8 dispatch): the
    step reads nothing back, not even the counts (a2a.permute(...,
    wait=False), the experts on torch's grouped GEMMs by offsets on the
    device); the call's plan then gives T, the bound, as its capacity."""

    expert_cache: ExpertCache | None = None
    assignment_cache: AssignmentCache | None = None
    # Inference calls whose every rank has at most this many tokens go through a2a.LowLatencyBuffer
    # (deployment/low_latency.py); 0: never.
    low_latency_tokens: int = 0
    wait: bool = True
    flow = "dropless"

    def __post_init__(self) -> None:
        if self.expert_cache is not None and not isinstance(self.expert_cache, ExpertCache):
            raise TypeError(f"expert_cache must be a moe_runtime.ExpertCache, got {type(self.expert_cache).__name__}")
        cache = self.assignment_cache
        if cache is not None and not isinstance(cache, AssignmentCache):
            raise TypeError(f"assignment_cache must be a moe_runtime.AssignmentCache, got {type(cache).__name__}")
        tokens = self.low_latency_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"low_latency_tokens must be an int >= 0 (0: no low-latency path), got {tokens!r}")
        if not isinstance(self.wait, bool):
            raise TypeError(f"wait must be True or False, got {self.wait!r}")
        others = [name for name, on in (("expert_cache", self.expert_cache is not None),
                                        ("assignment_cache", cache is not None),
                                        ("low_latency_tokens", tokens > 0)) if on]
        if not self.wait and others:
            raise ValueError(f"Dropless(wait=False) reads no count back, which {', '.join(others)} need")


class DroplessFlow(WholeExpertFlow):
    """Nothing dropped or padded; r = 1, d = 1, whole experts on every rank."""

    name = "dropless"
    fp8_dispatch = True

    def __init__(self, context, settings: Dropless | None = None):
        super().__init__(context, settings or Dropless())
        self.expert_cache = self.settings.expert_cache
        self.assignment_cache = self.settings.assignment_cache
        self._cached_versions: tuple | None = None  # the expert parameters' versions the cache holds
        self.assignment_stats = None  # the last call's sample-assignment caching (None without sample_ids)
        if self.assignment_cache is not None and context.dispatch_format is not None:
            raise ValueError("MoELayer(flow=Dropless(assignment_cache=...)) predicts its dispatch in the tokens' "
                             "dtype; it does not take dispatch_dtype (FP8)")
        if not self.settings.wait and (context.exchange_comm.size > 1 or context.dispatch_format is not None):
            raise ValueError(
                "MoELayer(flow=Dropless(wait=False)) takes one rank and no dispatch_dtype: an exchange sizes its "
                f"messages by the counts (here {context.exchange_comm.size} ranks, dispatch_dtype "
                f"{context.dispatch_format}); over several ranks the expert flow's capacity_factor=0 with "
                "dropless_capacity='worst_case' drops nothing without a wait")
        if self.assignment_cache is not None:
            self.assignment_cache.bind(self)  # one layer per cache
        self.low_latency = None
        if self.settings.low_latency_tokens:
            self.low_latency = LowLatencyPath(context.exchange_comm, self.settings.low_latency_tokens,
                                              context.num_experts, context.model_dim, context.dispatch_format)
            check_thread_level(context.exchange_comm, "sample-assignment caching runs the predicted dispatch")

    @classmethod
    def check_layer(cls, layer: Any) -> None:
        whole_expert_layer(cls.name, layer)
        if not layer.is_postscore:
            raise ValueError("MoELayer(flow='dropless') applies the gates at the combine: is_postscore must be True")
        if layer.batch_prioritized_routing:
            raise ValueError("MoELayer(flow='dropless') drops nothing, so batch_prioritized_routing (which orders "
                             "who is dropped) has no meaning there")

    def begin(self, tokens: torch.Tensor, top_k: int, sample_ids: Any, algo: str | None,
              call: CallFields) -> CachedDispatch | None:
        """Sample-assignment caching, before the gate (collective when the flow
        has a cache: its agreement checks `call` first, since the tokens' model
        dim sizes the predicted dispatch)."""
        if self.assignment_cache is None:
            return super().begin(tokens, top_k, sample_ids, algo, call)
        context = self.context
        return CachedDispatch.begin(self.assignment_cache, sample_ids, tokens, top_k, context.num_experts,
                                    agree_comm=context.comm, comm=context.exchange_comm, overlap=context.overlap,
                                    algo=context.default_algo if algo is None else algo, call=call)

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        context = self.context
        indices = call.decision.indices.contiguous()
        dispatched, stats = None, None
        if call.prepared is not None:
            dispatched = call.prepared.finish(call.tokens, indices)
            stats = call.prepared.stats
        cache = self._bound_cache(call.tokens.device) if self.expert_cache is not None and not call.recording else None
        weights = self.whole_expert_weights(call.tokens.dtype)
        if self.low_latency is not None and cache is None and self.low_latency.fits(call.recording_anywhere,
                                                                                    call.token_counts, call.prepared):
            y, rows, sent = self.low_latency.run(call.tokens, indices, call.decision.gates, weights,
                                                 context.experts.activation_fn)
            capacity = call.capacity or (int(rows.max()) if rows is not None and rows.size else 0)
            return y, Plan(1, 1, call.choice.algo, capacity, capacity, 0, sent, flow=self.name, low_latency=True)
        y, rows, sent = dropless_moe(call.tokens, indices, call.decision.gates, weights=weights,
                                     activation=context.experts.activation_fn, comm=context.exchange_comm,
                                     algo=call.choice.algo, weight_grad_scale=context.weight_grad_scale,
                                     dispatched=dispatched, expert_cache=cache, fp8=context.dispatch_format,
                                     count_comm=context.kept.comm, wait=self.settings.wait)
        self.assignment_stats = stats
        # As the dictionary's choice the plan keeps the agreed capacity (its key); alone, the most rows, or
        # without a wait T, which bounds them (a token chooses an expert once).
        capacity = call.capacity or (call.tokens.shape[0] if rows is None else int(rows.max()) if rows.size else 0)
        return y, Plan(1, 1, call.choice.algo, capacity, capacity, 0, sent, flow=self.name)

    def _bound_cache(self, device: torch.device) -> ExpertCache:
        """The expert cache holding the current expert weights: (re)bound when
        a parameter changed since (an optimizer step, a load) or the tokens
        moved to another device."""
        named = zip(CACHED_WEIGHT_NAMES, self.context.experts.local_weights(), strict=True)
        weights = {name: p for name, p in named if p is not None}
        versions = (device, *((p.data_ptr(), p._version) for p in weights.values()))
        if versions != self._cached_versions:
            self.expert_cache.bind(weights, device)
            self._cached_versions = versions
        return self.expert_cache
