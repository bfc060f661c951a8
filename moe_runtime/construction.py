"""An MoELayer's construction: its arguments checked, resolved into the flow
that runs (moe_runtime.registry), and agreed across ranks before any other
collective of the layer (:func:`agreed_construction`).

The fields every rank must construct alike (:func:`layer_fields`, agreed by
moe_runtime.common.agreement.agree_construction) are read from the
arguments, normalized so that two spellings of one setting agree (a gate
dict without ``capacity_factor`` and one with its default; ``count_per_node``
for ``num_experts_per_device``; no ``activation_fn`` and relu) and tolerant
of invalid values: a rank whose own checks failed joins the agreement with
its error as the field ``arguments``, so that every rank raises (the
mismatch names it), and an error every rank shares is raised by each.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import a2a

from .common.agreement import agree_construction, callable_name
from .common.host_values import all_gather_values
from .common.precision import dispatch_format
from .flows.base import Flow
from .gating.capacity import DROPLESS_CAPACITIES, RULES
from .gating.custom import DEFAULTS as CUSTOM_DEFAULTS
from .gating.gates import CosineTopKGate, LinearTopKGate
from .registry import dictionary_flows_of, flow_of
from .tuning.dictionary import AdaptiveDictionary

__all__ = ["BY_PRESENCE", "agreed_construction", "agreed_seeds", "layer_fields"]

_GATES = {"top": LinearTopKGate, "cosine_top": CosineTopKGate}
# Settings that are objects with state (the dictionary): they count by whether they were given (that
# changes the call's collectives). The flows' settings objects are compared field by field, and an
# object among them (a cache) by its type (common.agreement.describe).
BY_PRESENCE = ("adaptive",)


def _gate_defaults(kind: Any) -> dict[str, Any]:
    gate = _GATES.get(kind) if isinstance(kind, str) else None
    if gate is None:
        return {}
    parameters = inspect.signature(gate).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}


def _normalized_gate(spec: Any) -> dict[str, Any]:
    """A gate dict with the gate's defaults filled in and numbers as the gate keeps them."""
    if isinstance(spec, torch.nn.Module):  # a user's gate: what the layer reads of it (as it will read it)
        read = {"k": getattr(spec, "top_k", None), "num_global_experts": getattr(spec, "num_global_experts", "E")}
        return {"type": spec, **read, **{key: getattr(spec, key, default) for key, default in CUSTOM_DEFAULTS.items()}}
    if not isinstance(spec, dict):
        return {"type": spec}
    kind = spec.get("type", "top")
    defaults = _gate_defaults(kind)
    gate = {**defaults, **{key: value for key, value in spec.items() if key != "type"}}
    for key, default in defaults.items():
        if isinstance(default, (bool, float)) and not isinstance(gate[key], str):
            try:
                gate[key] = type(default)(gate[key])
            except (TypeError, ValueError):
                pass  # shown as given; the gate's own check rejects it
    return {"type": kind, **gate}


def _gate_fields(gate_type: Any) -> dict[str, Any]:
    """gate_type, k, capacity_factor and the other options: one value per
    gate (a tuple), or the value itself for a single gate dict."""
    single = isinstance(gate_type, dict)
    specs = [gate_type] if single else list(gate_type) if isinstance(gate_type, (list, tuple)) else [gate_type]
    gates = [_normalized_gate(spec) for spec in specs]

    def per_gate(values: list[Any]) -> Any:
        return values[0] if single else tuple(values)

    return {
        "gate_type": per_gate([gate["type"] for gate in gates]),
        "k": per_gate([gate.get("k") for gate in gates]),
        "capacity_factor": per_gate([gate.get("capacity_factor") for gate in gates]),
        "gate_options": per_gate([{key: value for key, value in gate.items()
                                   if key not in ("type", "k", "capacity_factor")} for gate in gates]),
    }


def _expert_fields(experts: Any) -> dict[str, Any]:
    spec = experts if isinstance(experts, dict) else {}
    activation = spec.get("activation_fn") or F.relu  # as the expert layouts read it
    return {
        "experts_type": spec.get("type", "ffn") if spec else experts,
        "num_experts_per_device": spec.get("num_experts_per_device", spec.get("count_per_node", 1)),
        "hidden_size_per_expert": spec.get("hidden_size_per_expert"),
        "has_fc1_bias": bool(spec.get("has_fc1_bias", True)),
        "has_fc2_bias": bool(spec.get("has_fc2_bias", True)),
        "activation_fn": callable_name(activation),
    }


def layer_fields(gate_type: Any, model_dim: Any, experts: Any, **settings: Any) -> dict[str, Any]:
    """The fields of an MoELayer's construction: model_dim, the experts
    dictionary's (num_experts_per_device, hidden_size_per_expert, the biases,
    activation_fn by name), the gates' (gate_type, k, capacity_factor,
    gate_options), the parameters' dtype (torch's default dtype, in which they
    are created), then `settings` (the layer's other arguments by name; those
    of BY_PRESENCE count by whether they were given)."""
    fields: dict[str, Any] = {"model_dim": model_dim, **_expert_fields(experts), **_gate_fields(gate_type),
                              "dtype": torch.get_default_dtype()}
    for name, value in settings.items():
        fields[name] = (value is not None) if name in BY_PRESENCE else value
    flow_settings = fields.get("flow_settings")
    if dataclasses.is_dataclass(flow_settings) and not isinstance(flow_settings, type):
        if hasattr(flow_settings, "hidden_split"):  # agreed by Hexa-MoE's layout itself, with its own message
            flow_settings = dataclasses.replace(flow_settings, hidden_split=None)
        if flow_settings == type(flow_settings)():  # the defaults: as the flow's name alone gives them
            flow_settings = None
        fields["flow_settings"] = flow_settings
    return fields


def agreed_construction(comm: a2a.Comm, gate_type: Any, model_dim: Any, experts: Any, *, flow: Any, flows: Any,
                        deprecated: dict[str, Any], **settings: Any) -> tuple[type[Flow], Any, dict[str, Any]]:
    """Collective: the flow class and its settings, and the dictionary's other
    flows (name -> settings), after checking the arguments on this rank and
    agreeing on them across ranks (see the module docstring)."""
    if not isinstance(comm, a2a.Comm):
        raise TypeError(f"comm must be an a2a.Comm, got {type(comm).__name__}")
    error, flow_class, flow_settings, others = None, None, flow, {}
    try:
        others = dictionary_flows_of(flows, deprecated)
        flow_class, flow_settings = flow_of(flow, deprecated)
        _check(model_dim, settings)
    except (TypeError, ValueError) as caught:
        error = caught  # raised after the agreement, which tells the other ranks
    name = flow_class.name if flow_class is not None else flow
    agree_construction(comm, "MoELayer", layer_fields(
        gate_type, model_dim, experts, arguments="valid" if error is None else f"invalid: {error}", flow=name,
        flow_settings=flow_settings, flows=tuple(others.items()), **settings))
    if error is not None:
        raise error
    return flow_class, flow_settings, others


def _check(model_dim: Any, settings: dict[str, Any]) -> None:
    if not isinstance(model_dim, int) or isinstance(model_dim, bool) or model_dim <= 0:
        raise ValueError(f"model_dim must be a positive integer, got {model_dim!r}")
    if settings["capacity_rule"] not in RULES:
        raise ValueError(f"capacity_rule must be one of {RULES}, got {settings['capacity_rule']!r}")
    graphs = settings["cuda_graphs"]
    if not isinstance(graphs, int) or isinstance(graphs, bool) or graphs < 0:
        raise ValueError(f"cuda_graphs must be a non-negative integer (the most call signatures captured; 0: "
                         f"none), got {graphs!r}")
    if settings["dropless_capacity"] not in DROPLESS_CAPACITIES:
        raise ValueError(f"dropless_capacity must be one of {DROPLESS_CAPACITIES}, got {settings['dropless_capacity']!r}")
    if settings["expert_gradient"] not in ("mean", "sum"):
        raise ValueError(f"expert_gradient must be 'mean' or 'sum', got {settings['expert_gradient']!r}")
    dispatch_format(settings["dispatch_dtype"])
    adaptive = settings["adaptive"]
    if adaptive is not None and not isinstance(adaptive, AdaptiveDictionary):
        raise TypeError(f"adaptive must be a moe_runtime.AdaptiveDictionary, got {type(adaptive).__name__}")


def agreed_seeds(seeds: tuple[int, int] | None, comm: a2a.Comm) -> tuple[int, int]:
    """(gate_seed, expert_seed): the ones given, or, given None, rank 0's draws (collective)."""
    if seeds is None:
        drawn = np.array([int(torch.randint(0, 2**31 - 1, (1,))) for _ in range(2)], dtype=np.int64)
        table = all_gather_values(drawn, comm).reshape(comm.size, 2)
        return int(table[0, 0]), int(table[0, 1])  # rank 0's
    if len(seeds) != 2:
        raise ValueError(f"seeds must be (gate_seed, expert_seed), got {seeds!r}")
    return int(seeds[0]), int(seeds[1])
