"""Every flow by name, and the one way to say which runs.

``MoELayer(flow=...)`` takes a name or a settings object:

=================  ===============================  =========================================
flow=              settings object                  runs (package)
=================  ===============================  =========================================
"expert"           (Tutel's keywords: parallel_type,  Tutel's capacity flow: r, d, algorithm
                   a2a_ffn_overlap_degree, use_2dh,  (moe_runtime.flows.expert)
                   adaptive)
"dropless"         Dropless(expert_cache=,           every choice, nothing padded, r = 1
                   assignment_cache=)                (moe_runtime.deployment)
"dynamic"          DynamicCapacity(...)              one capacity per expert (moe_runtime.dynamic)
"flex"             FlexConfig(...)                   FlexMoE's vExpert replicas (moe_runtime.flex)
"data_centric"     DataCentric(hidden_split=,        Hexa-MoE, experts sharded along H, gathered
                   shared_cache=, kernels=)          whole per call (moe_runtime.hexa)
"model_centric"    ModelCentric(hidden_split=,       Hexa-MoE, tokens gathered (moe_runtime.hexa)
                   kernels=)
=================  ===============================  =========================================

A name gives the flow its default settings. ``flows=`` names the other
flows the dictionary of an "expert" layer may choose per capacity
(DICTIONARY_FLOWS), run on the same experts. Words: a *flow* is one of
these; *parallel* is Tutel's ``parallel_type`` (the expert flow's r);
"dispatcher" is no longer a setting. The keywords of earlier releases
(``dispatcher=``, ``parallel=``, ``flex=``, ``expert_cache=``,
``dynamic_capacity=``, ``assignment_cache=``, ``hidden_split=``,
``shared_cache=``) still work for one release, with a DeprecationWarning
naming the flow= that replaces them.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

from .deployment.flow import Dropless, DroplessFlow
from .dynamic.capacity import DynamicCapacity
from .dynamic.flow import DynamicFlow
from .flex.config import FlexConfig
from .flex.flow import FlexFlow
from .flows.agreement import ALGORITHMS
from .flows.base import Flow
from .flows.expert import ExpertFlow, positive_degree
from .hexa.cache import PipelineSharedCache
from .hexa.flow import DataCentric, DataCentricFlow, ModelCentric, ModelCentricFlow
from .tuning.dictionary import FLOWS as TUNED_FLOWS

__all__ = ["DICTIONARY_FLOWS", "FLOWS", "call_capacity_factor", "call_top_k", "check_dictionary_layer", "dictionary_flows_of",
           "flow_of"]

FLOWS: dict[str, type[Flow]] = {flow.name: flow for flow in (
    ExpertFlow, DroplessFlow, DynamicFlow, FlexFlow, DataCentricFlow, ModelCentricFlow)}
SETTINGS: dict[type, str] = {Dropless: "dropless", DynamicCapacity: "dynamic", FlexConfig: "flex",
                             DataCentric: "data_centric", ModelCentric: "model_centric"}
DICTIONARY_FLOWS = TUNED_FLOWS[1:]  # "dropless", "data_centric", "model_centric": the dictionary's other flows
DEPRECATED = ("dispatcher", "parallel", "flex", "expert_cache", "dynamic_capacity", "assignment_cache",
              "hidden_split", "shared_cache")


def flow_of(flow: Any, deprecated: dict[str, Any]) -> tuple[type[Flow], Any]:
    """The flow class and its settings of ``MoELayer(flow=..., **deprecated)``
    (flow None: "expert", unless the deprecated keywords say otherwise)."""
    unknown = sorted(set(deprecated) - set(DEPRECATED))
    if unknown:
        raise TypeError(f"MoELayer got unexpected keyword argument(s) {unknown}")
    if deprecated:
        if flow is not None:
            raise ValueError(f"MoELayer: give flow= or the deprecated {sorted(deprecated)}, not both")
        flow = _from_deprecated(**deprecated)
        named = repr(flow) if isinstance(flow, str) else f"{type(flow).__name__}(...)"
        warnings.warn(f"MoELayer({', '.join(f'{k}=' for k in sorted(deprecated))}) is deprecated: say what runs "
                      f"with flow={named} (moe_runtime.registry)", DeprecationWarning, stacklevel=4)  # the caller of MoELayer(), through construction.agreed_construction
    flow = "expert" if flow is None else flow
    if isinstance(flow, str):
        if flow not in FLOWS:
            raise ValueError(f"flow must be one of {tuple(FLOWS)} or a settings object "
                             f"({', '.join(kind.__name__ for kind in SETTINGS)}), got {flow!r}")
        return FLOWS[flow], None
    name = SETTINGS.get(type(flow))
    if name is None:
        raise TypeError(f"flow must be a name of {tuple(FLOWS)} or one of "
                        f"{[kind.__name__ for kind in SETTINGS]}, got {type(flow).__name__}")
    return FLOWS[name], flow


def _from_deprecated(dispatcher: str = "capacity", parallel: str = "expert", flex: Any = None,
                     expert_cache: Any = None, dynamic_capacity: Any = None, assignment_cache: Any = None,
                     hidden_split: Any = None, shared_cache: Any = None) -> Any:
    """The flow= of the keywords of earlier releases, with their refusals."""
    if parallel not in ("expert", "data_centric", "model_centric"):
        raise ValueError(f"parallel must be one of ('expert', 'data_centric', 'model_centric'), got {parallel!r}")
    if dispatcher not in ("capacity", "dropless", "dynamic"):
        raise ValueError(f"dispatcher must be one of ('capacity', 'dropless', 'dynamic'), got {dispatcher!r}")
    if shared_cache is not None and not isinstance(shared_cache, PipelineSharedCache):
        raise TypeError(f"shared_cache must be a moe_runtime.PipelineSharedCache, got {type(shared_cache).__name__}")
    if parallel != "expert":
        given = [name for name, value in (("dispatcher", None if dispatcher == "capacity" else dispatcher),
                                          ("flex", flex), ("expert_cache", expert_cache),
                                          ("dynamic_capacity", dynamic_capacity),
                                          ("assignment_cache", assignment_cache)) if value is not None]
        if given:
            raise ValueError(f"MoELayer(parallel={parallel!r}) shards every expert along the hidden size over "
                             f"every rank; it takes none of {given}")
    if shared_cache is not None and parallel != "data_centric":
        raise ValueError("shared_cache= is the setting of the data-centric flow: parallel='data_centric', or "
                         "flows= with 'data_centric'")
    if parallel == "model_centric":
        return ModelCentric(hidden_split)
    if parallel == "data_centric":
        return DataCentric(hidden_split, shared_cache)
    if hidden_split is not None:
        raise ValueError("hidden_split= is the setting of parallel='data_centric' or 'model_centric' (experts "
                         "sharded along the hidden size), not of parallel='expert'")
    if dynamic_capacity is not None and not isinstance(dynamic_capacity, DynamicCapacity):
        raise TypeError(f"dynamic_capacity must be a moe_runtime.DynamicCapacity, got {type(dynamic_capacity).__name__}")
    if dynamic_capacity is not None and dispatcher != "dynamic":
        raise ValueError(f"dynamic_capacity= is the setting of dispatcher='dynamic', not {dispatcher!r}")
    if dispatcher != "dropless":
        if expert_cache is not None:
            raise ValueError("expert_cache needs dispatcher='dropless': the other flows compute every local expert "
                             "(padded buffers), active or not, so there is nothing to leave on the host")
        if assignment_cache is not None:
            raise ValueError("assignment_cache needs dispatcher='dropless': the predicted dispatch starts before "
                             "the gate, and the capacity dispatcher's buffers depend on a capacity the gate decides")
        if flex is not None:
            raise ValueError(f"flex= needs dispatcher='dropless' (FlexMoE routes every choice to a replica), "
                             f"got dispatcher={dispatcher!r}")
        if dispatcher == "dynamic":
            return dynamic_capacity or DynamicCapacity()
        return "expert"
    if flex is not None:
        if expert_cache is not None or assignment_cache is not None:
            raise ValueError("flex= does not combine with expert_cache= or assignment_cache= (they assume each "
                             "expert on one rank)")
        if not isinstance(flex, FlexConfig):
            raise TypeError(f"flex must be a moe_runtime.FlexConfig, got {type(flex).__name__}")
        return flex
    return Dropless(expert_cache, assignment_cache)


def dictionary_flows_of(flows: Any, deprecated: dict[str, Any]) -> dict[str, Any]:
    """The layer's flows= checked: name -> settings (None: the defaults), in
    DICTIONARY_FLOWS' order. An entry is a name or a settings object
    (``DataCentric(shared_cache=...)``). The deprecated ``shared_cache=`` of a
    layer whose flows= hold "data_centric" moves into that flow's settings."""
    if isinstance(flows, (str, bytes)) or not isinstance(flows, Sequence):
        raise TypeError(f"flows must be a list or tuple of {DICTIONARY_FLOWS}, got {type(flows).__name__} "
                        f"{flows!r}")
    named: dict[str, Any] = {}
    for flow in flows:
        name = flow if isinstance(flow, str) else SETTINGS.get(type(flow))
        if name not in DICTIONARY_FLOWS:
            raise ValueError(f"flows: unknown flow {flow!r}; the dictionary's other flows are {DICTIONARY_FLOWS} "
                             "(the expert flow of (r, d, algorithm) is always among its choices)")
        if name in named:
            raise ValueError(f"flows has duplicates: {list(flows)}")
        named[name] = None if isinstance(flow, str) else flow
    if "data_centric" in named and "shared_cache" in deprecated and deprecated.get("parallel", "expert") == "expert":
        named["data_centric"] = DataCentric(shared_cache=deprecated.pop("shared_cache"))
        warnings.warn("MoELayer(shared_cache=) is deprecated: give flows=(..., DataCentric(shared_cache=...))",
                      DeprecationWarning, stacklevel=4)  # the caller of MoELayer(), through construction.agreed_construction
    return {name: named[name] for name in DICTIONARY_FLOWS if name in named}


def check_dictionary_layer(layer: Any, flow: type[Flow]) -> None:
    """What an expert-parallel layer with flows= must be, checked at construction.

    The other flows compute what the expert flow computes only when it drops
    nothing, so the layer must route with the capacity that drops nothing
    (capacity factor 0), apply the gates after the experts (is_postscore),
    and hold whole experts (the layout every flow gathers from)."""
    flows = layer.flows
    name = f"MoELayer(flows={flows})"
    if flow.name != "expert":
        raise ValueError(f"{name}: 'flows' are the choices of the expert flow's dictionary besides its own (r, d, "
                         f"algorithm): they need flow='expert', not flow={flow.name!r}")
    if layer.adaptive is None:
        raise ValueError(f"{name}: the flows are choices of the dictionary; construct the layer with "
                         "parallel_type='adaptive:auto' or adaptive=AdaptiveDictionary(...)")
    if layer.experts.sharers > 1:
        raise ValueError(f"{name} needs whole experts on every rank (num_experts_per_device > 0: the layout every "
                         f"flow gathers from), but {layer.experts.sharers} ranks share each expert")
    why = ("the other flows drop nothing, so they compute the expert flow's function only when it drops nothing "
           "either")
    for index, gate in enumerate(layer.gates):
        if gate.capacity_factor != 0:
            raise ValueError(f"{name}: gate {index} has capacity_factor={gate.capacity_factor}; {why}: give "
                             "capacity_factor=0 (the smallest capacity that drops nothing; a negative factor caps "
                             "it, and drops)")
    if not layer.is_postscore:
        raise ValueError(f"{name}: the other flows apply the gates to the experts' outputs: is_postscore must be True")
    if layer.batch_prioritized_routing:
        raise ValueError(f"{name}: nothing is dropped, so batch_prioritized_routing (which orders who is dropped) "
                         "has no meaning here")
    if "model_centric" in flows and layer.experts.hidden_size < layer.comm.size:
        raise ValueError(f"{name}: model_centric gives every rank a hidden slice of every expert, but "
                         f"hidden_size_per_expert={layer.experts.hidden_size} is smaller than the "
                         f"{layer.comm.size} ranks")


def call_capacity_factor(flows: tuple[str, ...], gate: Any, given: Any) -> float:
    """A call's capacity factor: `given` (the call's), else the gate's; a finite real number (0 or less:
    dropless), else ValueError; and 0 for a layer with flows= (ValueError otherwise)."""
    factor = gate.capacity_factor if given is None else given
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor):
        raise ValueError(f"capacity_factor must be a finite real number (0 or less: dropless), got {factor!r}")
    if flows and factor != 0:
        raise ValueError(f"MoELayer(flows={flows}): capacity_factor={factor} may drop choices, which the other flows "
                         "never do, so they would not compute the same function; call with capacity_factor=0")
    return float(factor)


def check_dispatch_dtype(layer: Any, flow: type[Flow], others: Sequence[str]) -> None:
    """What MoELayer(dispatch_dtype=FP8) needs, checked at construction: flows
    that carry FP8 rows (Flow.fp8_dispatch), for the layer's flow and the
    dictionary's others, and the gates applied at the combine (an FP8 row
    carries the token, not the token times its gate)."""
    if layer.dispatch_format is None:
        return
    name = f"MoELayer(dispatch_dtype={layer.dispatch_dtype!r})"
    carrying = sorted(n for n, f in FLOWS.items() if f.fp8_dispatch)
    for flow_name in (flow.name, *others):
        if not FLOWS[flow_name].fp8_dispatch:
            raise ValueError(f"{name}: flow {flow_name!r} does not carry FP8 rows; the flows that do are {carrying}")
    if not layer.is_postscore:
        raise ValueError(f"{name} applies the gates at the combine, as DeepEP does: is_postscore must be True")


def call_top_k(layer: Any, gate_index: int, top_k: int | None, request: Any) -> int:
    """This rank's own checks of a call's arguments (MoELayer.forward's); the call's k."""
    if not 0 <= gate_index < len(layer.gates):
        raise ValueError(f"gate_index {gate_index} is out of range: the layer has {len(layer.gates)} gate(s)")
    k = layer.gates[gate_index].top_k if top_k is None else top_k
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"top_k must be a positive integer, got {k!r}")
    if request.algo is not None and request.algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS}, got {request.algo!r}")
    if request.d is not None:
        positive_degree(request.d)
    if request.flow is not None and request.flow not in layer._flows:
        raise ValueError(f"flow={request.flow!r}: this layer's flows are 'expert' and its flows= {layer.flows}"
                         if layer.flows else f"flow={request.flow!r} picks one of the flows of a layer "
                         "constructed with flows=(...) (and the dictionary)")
    return min(k, layer.num_global_experts)  # as Tutel: k above E means E
