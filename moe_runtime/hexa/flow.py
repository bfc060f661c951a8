"""Hexa-MoE's data- and model-centric flows (moe_runtime.hexa.centric) as
:class:`moe_runtime.flows.base.Flow` implementations.

Alone (``MoELayer(flow="data_centric")`` or ``flow=DataCentric(...)``, and
model-centric alike) they run on every expert sharded along its hidden size
over every rank (moe_runtime.hexa.experts; ``hidden_split``: the ranks' H_w,
uniform by default, e.g. ``split_by_latency(H, latencies)``). As choices of
an expert-parallel layer's dictionary (``flows=``) they run on Tutel's whole
experts and gather what they need from them. Either way tokens go in their
order through the expert-specific operators, or on rows grouped by expert
through grouped GEMMs (``kernels``; by default the grouped GEMMs wherever
torch runs them: moe_runtime.hexa.rows), nothing is dropped, and ranks
may hold different numbers of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import a2a

from ..flows.base import Call, Flow, Plan
from .cache import SHARED_CACHE, PipelineSharedCache
from .centric import KERNELS, data_centric_moe, model_centric_moe
from .experts import HiddenShardedExperts

__all__ = ["DataCentric", "DataCentricFlow", "ModelCentric", "ModelCentricFlow"]

_WHY = "nothing is dropped or pipelined here, and no rows are exchanged by all-to-all"


def _check_kernels(kernels: Any) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


@dataclass(frozen=True)
class DataCentric:
    """The data-centric flow's settings: the hidden split of the experts'
    shards (None: uniform), the pipeline-shared cache the layer's full
    experts go into (None: moe_runtime.hexa.cache.SHARED_CACHE), and how the
    experts are computed (``kernels``: "auto", "es" or "grouped";
    moe_runtime.hexa.centric.KERNELS)."""

    hidden_split: Sequence[int] | None = None
    shared_cache: PipelineSharedCache | None = None
    kernels: str = "auto"
    flow = "data_centric"

    def __post_init__(self) -> None:
        if self.shared_cache is not None and not isinstance(self.shared_cache, PipelineSharedCache):
            raise TypeError(f"shared_cache must be a moe_runtime.PipelineSharedCache, got "
                            f"{type(self.shared_cache).__name__}")
        _check_kernels(self.kernels)


@dataclass(frozen=True)
class ModelCentric:
    """The model-centric flow's settings: the hidden split (None: uniform)
    and ``kernels`` (as DataCentric's)."""

    hidden_split: Sequence[int] | None = None
    kernels: str = "auto"
    flow = "model_centric"

    def __post_init__(self) -> None:
        _check_kernels(self.kernels)


class _HexaFlow(Flow):
    why_refused = _WHY

    @classmethod
    def layout(cls, spec: dict[str, Any], model_dim: int, comm: a2a.Comm, expert_seed: int,
               settings: Any) -> HiddenShardedExperts:
        split = None if settings is None else settings.hidden_split  # a name alone: the uniform split
        return HiddenShardedExperts(spec, model_dim, comm, expert_seed, split)

    @classmethod
    def check_layer(cls, layer: Any) -> None:
        """The expert-parallel flows' settings have no meaning here."""
        given = sorted(name for name, (value, default) in layer.expert_parallel_settings().items()
                       if value is not default and value != default)
        if given:
            raise ValueError(f"MoELayer(flow={cls.name!r}) shards every expert along the hidden size over every "
                             f"rank and routes every choice (no capacity, no exchange of rows to pipeline or to "
                             f"route); it takes none of {given}")

    @property
    def sharded(self) -> bool:
        """Whether the layout is Hexa-MoE's (else Tutel's whole experts, for the dictionary)."""
        return isinstance(self.context.experts, HiddenShardedExperts)

    def require_one_dtype(self, call: Call) -> None:
        """The expert-specific operators take the tokens and weights in one dtype."""
        weights = self.context.experts.batched_fc1_w.dtype
        if call.tokens.dtype != weights:
            raise ValueError(f"MoELayer(flow={self.name!r}) computes with a2a's expert-specific operators, which take "
                             f"the tokens and the weights in one dtype; the tokens are {call.tokens.dtype} (autocast) "
                             f"and the weights {weights}: convert the layer (layer.to({call.tokens.dtype})) instead "
                             "of autocasting it")

    def plan(self, call: Call, r: int, sent: int) -> Plan:
        if self.sharded:
            most = int(max(call.token_counts))
            return Plan(r, 1, "linear", most, most, 0, sent, parallel=self.name, flow=self.name)
        return Plan(r, 1, "linear", call.capacity, call.capacity, 0, sent, flow=self.name)


class DataCentricFlow(_HexaFlow):
    """The experts gathered whole into the pipeline-shared cache, r = 0."""

    name = "data_centric"

    def __init__(self, context, settings: DataCentric | None = None):
        super().__init__(context, settings or DataCentric())
        self.cache = SHARED_CACHE if self.settings.shared_cache is None else self.settings.shared_cache
        self.cache_token = self.cache.register(context.experts)

    def settle(self) -> None:
        self.cache.wait()  # a prefetch runs on the communication thread: done before this thread's next MPI call

    def prefetch(self) -> None:
        """Starts gathering the experts into the cache on the communication thread."""
        context = self.context
        self.cache.prefetch(self.cache_token, context.experts, context.exchange_comm, context.overlap)

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        context = self.context
        self.require_one_dtype(call)
        y = data_centric_moe(call.tokens, call.decision.indices, call.decision.gates, experts=context.experts,
                             cache=self.cache, token=self.cache_token, comm=context.exchange_comm,
                             weight_grad_scale=context.weight_grad_scale, kernels=self.settings.kernels)
        return y, self.plan(call, 0, 0)


class ModelCentricFlow(_HexaFlow):
    """Every rank's tokens through this rank's hidden slice of every expert, r = W."""

    name = "model_centric"

    def __init__(self, context, settings: ModelCentric | None = None):
        super().__init__(context, settings or ModelCentric())

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        context = self.context
        world = context.comm.size
        self.require_one_dtype(call)
        y = model_centric_moe(call.tokens, call.decision.indices, call.decision.gates, experts=context.experts,
                              token_counts=call.token_counts, comm=context.exchange_comm,
                              weight_grad_scale=context.weight_grad_scale, kernels=self.settings.kernels)
        return y, self.plan(call, world, call.tokens.shape[0] * (world - 1))
