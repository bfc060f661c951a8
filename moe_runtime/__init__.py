"""moe_runtime: the PyTorch Mixture-of-Experts layer over a2a.

>>> import a2a, moe_runtime
>>> comm = a2a.Comm.from_mpi()
>>> layer = moe_runtime.MoELayer({"type": "top", "k": 2}, 1024,
...     {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4096},
...     comm=comm, seeds=(1, 2), parallel_type="adaptive:auto")
>>> y = layer(x); loss = y.sum() + y.l_aux

Tutel's interface (a Tutel user changes the import), with switchable
parallelism r, pipelining degree d and the dictionary that picks (r, d,
algorithm) per capacity (Tutel Section 3). Pure Python over a2a's public
API; torch is required here, never by a2a. docs/runtime.md shows the data
layout at every step.

- :class:`MoELayer`, :func:`sync_shared_gradients` (layer.py)
- :class:`AdaptiveDictionary` and its :class:`Config` (tuner.py); its prior,
  :class:`ExchangePrior` (prior.py, over the scale model :mod:`a2a.sim`);
  the other flows it can choose, ``MoELayer(..., flows=("dropless",
  "data_centric", "model_centric"))`` on the same experts (dictionary_flows.py)
- :class:`ExpertCache`, expert buffering (expert_cache.py; policies and
  ``simulate`` in cache_policy.py, ``python -m moe_runtime.bench_cache``)
- expert placement: ``MoELayer.place`` (moves whole experts, relocation.py)
  and the policies and metrics of :mod:`moe_runtime.deployment.placement` (greedy,
  anti-correlation, Max Load), ``python -m moe_runtime.bench_placement``
- :class:`DynamicCapacity`, the per-expert capacity policy of
  ``MoELayer(dispatcher="dynamic")`` (dynamic_capacity.py; its flow is
  ragged.py), and :class:`CapacityTracker`, its state
- :class:`AssignmentCache`, sample-assignment caching (assignment_cache.py;
  the corrected dispatch of the prediction in cached_dispatch.py)
- FlexMoE: ``MoELayer(dispatcher="dropless", flex=FlexConfig(...))``,
  ``layer.rebalance(optimizer)`` / ``layer.adjust(primitives)``: vExpert
  slots and their primitives (vexperts.py: :class:`SlotTable`, Expand,
  Shrink, Migrate), Algorithm 3's routing (flex_routing.py), the flow
  (flex_dispatch.py), the layer's state (flex.py), the cost model and the
  scheduler (flex_cost.py, flex_scheduler.py); ``python -m moe_runtime.bench --flex``
- Hexa-MoE: ``MoELayer(parallel="data_centric" | "model_centric")``, experts
  sharded along H (hexa_experts.py), the two flows over the expert-specific
  operators (hexa.py), :class:`PipelineSharedCache` (hexa_cache.py, the one
  full copy the data-centric layers share; ``layer.prefetch()``)
- Hexa-MoE's heterogeneous split (hetero_split.py, Section 3.4):
  :func:`split_by_latency` (Equations 1 and 2, rounded to sum exactly),
  :func:`measure_latency` (the proxy matmul), :func:`rank_latencies` (every
  rank's, all-gathered), :func:`local_batch` (a rank's rows of a global batch)
- :func:`moe_reference`, the float64 single-process oracle (reference.py)
- gates and losses (gates.py, losses.py), capacity rules (capacity.py),
  expert parameters (experts.py), the flows (flows.py), pipelining
  (pipeline.py), reused buffers (buffers.py); ``python -m moe_runtime.bench``.
"""

from __future__ import annotations

from .deployment import placement
from .deployment.assignment_cache import AssignmentCache, AssignmentStats
from .deployment.expert_cache import ExpertCache
from .dynamic.capacity import CapacityTracker, DynamicCapacity
from .flex.config import FlexConfig
from .flex.vexperts import Expand, Migrate, Shrink, SlotTable
from .flows.expert import Plan
from .gating.capacity import buffer_capacity, local_capacity, rule_capacity
from .gating.gates import CosineTopKGate, LinearTopKGate
from .gating.losses import gshard_loss, load_importance_loss, z_loss
from .hexa.cache import PipelineSharedCache
from .hexa.split import local_batch, measure_latency, rank_latencies, split_by_latency
from .layer import MoELayer, sync_shared_gradients
from .reference import moe_reference
from .tuning.dictionary import AdaptiveDictionary, Config
from .tuning.prior import ExchangePrior

__all__ = [
    "AdaptiveDictionary",
    "AssignmentCache",
    "AssignmentStats",
    "CapacityTracker",
    "Config",
    "CosineTopKGate",
    "DynamicCapacity",
    "ExchangePrior",
    "Expand",
    "ExpertCache",
    "FlexConfig",
    "LinearTopKGate",
    "Migrate",
    "MoELayer",
    "PipelineSharedCache",
    "Plan",
    "Shrink",
    "SlotTable",
    "buffer_capacity",
    "gshard_loss",
    "load_importance_loss",
    "local_batch",
    "local_capacity",
    "measure_latency",
    "moe_reference",
    "placement",
    "rank_latencies",
    "rule_capacity",
    "split_by_latency",
    "sync_shared_gradients",
    "z_loss",
]
