"""moe_runtime: the PyTorch Mixture-of-Experts layer over a2a.

>>> import a2a, moe_runtime
>>> comm = a2a.Comm.from_mpi()
>>> layer = moe_runtime.MoELayer({"type": "top", "k": 2}, 1024,
...     {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4096},
...     comm=comm, seeds=(1, 2), parallel_type="adaptive:auto")
>>> y = layer(x); loss = y.sum() + y.l_aux

Tutel's interface (a Tutel user changes the import), with switchable
parallelism r, pipelining degree d and the dictionary that picks (r, d,
algorithm) per capacity (Tutel Section 3), and the other papers' flows
behind one interface. Pure Python over a2a's public API; torch is required
here, never by a2a. docs/architecture.md draws the packages, docs/runtime.md
the data layout at every step.

The house, bottom to top (a package imports only those below it):

- common/      host values agreed across ranks, the buffer pool, the communication thread
- gating/      gates, auxiliary losses, Tutel's capacity rules
- experts/     expert layouts (Tutel's whole or shared experts), FFN kernels, moving experts
- tuning/      the dictionary floor(c / R) -> configuration, its step protocol and prior
- flows/       the Flow interface, the per-call agreement (kept while rows repeat), Tutel's capacity flow (r, d, algorithm)
- deployment/ dynamic/ flex/ hexa/
               one package per paper: dropless and its caches, placement; per-expert capacity;
               FlexMoE's vExpert replicas; Hexa-MoE's data- and model-centric flows
- registry.py  every flow by name and settings; construction.py the layer's arguments checked and
               agreed across ranks; layer.py the MoELayer; reference.py the oracle
- bench/       python -m moe_runtime.bench (beside the library: nothing imports it)
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the layer, the gates and the experts are torch modules)
except ModuleNotFoundError as _error:
    if _error.name != "torch":
        raise
    raise ImportError(
        "moe_runtime needs PyTorch, which is not installed here: pip install \"a2a[torch]\" (from a "
        "source tree: pip install \".[torch]\"; torch==2.13.0), or a torch of your own. a2a works without it."
    ) from _error

from . import _moved
from .deployment import placement
from .deployment.assignment_cache import AssignmentCache, AssignmentStats
from .deployment.expert_cache import ExpertCache
from .deployment.flow import Dropless
from .dynamic.capacity import CapacityTracker, DynamicCapacity
from .experts.gradients import ddp_ignore_experts
from .flex.config import FlexConfig
from .flex.vexperts import Expand, Migrate, Shrink, SlotTable
from .flows.base import Plan
from .gating.capacity import buffer_capacity, local_capacity, rule_capacity
from .gating.gates import CosineTopKGate, LinearTopKGate
from .gating.losses import gshard_loss, load_importance_loss, z_loss
from .hexa.cache import PipelineSharedCache
from .hexa.flow import DataCentric, ModelCentric
from .hexa.split import local_batch, measure_latency, rank_latencies, split_by_latency
from .layer import MoELayer, sync_shared_gradients
from .reference import moe_reference
from .tuning.dictionary import AdaptiveDictionary, Config
from .tuning.prior import ExchangePrior

_moved.install()  # the module paths of earlier releases, with a DeprecationWarning

__all__ = [
    "AdaptiveDictionary",
    "AssignmentCache",
    "AssignmentStats",
    "CapacityTracker",
    "Config",
    "CosineTopKGate",
    "DataCentric",
    "Dropless",
    "DynamicCapacity",
    "ExchangePrior",
    "Expand",
    "ExpertCache",
    "FlexConfig",
    "LinearTopKGate",
    "Migrate",
    "MoELayer",
    "ModelCentric",
    "PipelineSharedCache",
    "Plan",
    "Shrink",
    "SlotTable",
    "buffer_capacity",
    "ddp_ignore_experts",
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
