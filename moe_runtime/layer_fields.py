"""The configuration of an MoELayer that every rank must construct alike, as
the fields of moe_runtime.common.agreement.agree_construction.

Read from the constructor's arguments before any of the layer's
collectives, normalized so that two spellings of one setting agree (a gate
dict without ``capacity_factor`` and one with its default; ``count_per_node``
for ``num_experts_per_device``; no ``activation_fn`` and relu) and tolerant
of invalid values (a rank with a wrong value shows it in the mismatch; the
layer's own checks, after the agreement, reject a value wrong on every rank).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .common.agreement import callable_name
from .gating.gates import CosineTopKGate, LinearTopKGate

__all__ = ["BY_PRESENCE", "layer_fields"]

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
    if dataclasses.is_dataclass(fields.get("flow_settings")) and hasattr(fields["flow_settings"], "hidden_split"):
        # The hidden split is agreed by Hexa-MoE's layout itself, with its own message.
        fields["flow_settings"] = dataclasses.replace(fields["flow_settings"], hidden_split=None)
    return fields
