"""The gates: which k experts each token goes to, and with what weight.

``gate_type`` takes Tutel's dictionaries:

- ``{"type": "top", "k": 2, "capacity_factor": 1.0, "gate_noise": 0.0, "fp32_gate": True}``:
  logits = x @ wg^T (``gate.wg``, a bias-free ``nn.Linear(M, E)``);
- ``{"type": "cosine_top", ...}`` (SwinV2-MoE): logits = cos(proj(x), sim) /
  temperature, over a projection to min(M // 2, 256) dimensions.

Both also take ``"z_loss_coef"`` (default 0). A torch module given in their
place is a user's gate (moe_runtime.gating.custom). :func:`decide` turns the logits
into the routing decision: in training, noise N(0, gate_noise / E) is added
to the logits; scores = softmax(logits); the top-k experts of each token by
score; their scores are the gates, normalized to sum 1 when k > 1 and
``normalize_gate``; the auxiliary loss of the scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..common.initialization import uniform
from .custom import checked_logits, custom_gate
from .losses import load_importance_loss, z_loss
from .topk import top_k_gating

__all__ = ["CosineTopKGate", "GateDecision", "LinearTopKGate", "decide", "initialize_gate", "make_gate"]

_GATE_KEYS = {"type", "k", "capacity_factor", "gate_noise", "fp32_gate", "z_loss_coef", "proj_dim", "init_t"}


class LinearTopKGate(torch.nn.Module):
    """logits = x @ wg^T; Tutel's "top" gate."""

    def __init__(self, model_dim: int, num_experts: int, *, k: int = 2, capacity_factor: float = 0.0,
                 gate_noise: float = 0.0, fp32_gate: bool = False, z_loss_coef: float = 0.0):
        super().__init__()
        self.top_k, self.capacity_factor, self.gate_noise = k, float(capacity_factor), float(gate_noise)
        self.fp32_gate, self.z_loss_coef = bool(fp32_gate), float(z_loss_coef)
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)

    def reset_parameters(self, generator: torch.Generator) -> None:
        bound = 1.0 / math.sqrt(self.wg.in_features)
        with torch.no_grad():
            self.wg.weight.copy_(uniform(self.wg.weight.shape, bound, generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_gate:
            return F.linear(x.float(), self.wg.weight.float())
        return self.wg(x.to(self.wg.weight.dtype))


class CosineTopKGate(torch.nn.Module):
    """logits = <proj(x)/|proj(x)|, sim_e/|sim_e|> * exp(min(temperature, log 100));
    Tutel's "cosine_top" gate (SwinV2-MoE)."""

    def __init__(self, model_dim: int, num_experts: int, *, k: int = 2, capacity_factor: float = 0.0,
                 gate_noise: float = 0.0, fp32_gate: bool = False, z_loss_coef: float = 0.0,
                 proj_dim: int | None = None, init_t: float = 0.5):
        super().__init__()
        self.top_k, self.capacity_factor, self.gate_noise = k, float(capacity_factor), float(gate_noise)
        self.fp32_gate, self.z_loss_coef = bool(fp32_gate), float(z_loss_coef)
        proj_dim = proj_dim or max(1, min(model_dim // 2, 256))
        self.init_t = float(init_t)
        self.cosine_projector = torch.nn.Linear(model_dim, proj_dim)
        self.sim_matrix = torch.nn.Parameter(torch.empty(proj_dim, num_experts))
        self.temperature = torch.nn.Parameter(torch.empty(1))
        self.clamp_max = math.log(1.0 / 0.01)

    def reset_parameters(self, generator: torch.Generator) -> None:
        bound = 1.0 / math.sqrt(self.cosine_projector.in_features)
        with torch.no_grad():
            self.cosine_projector.weight.copy_(uniform(self.cosine_projector.weight.shape, bound, generator))
            self.cosine_projector.bias.copy_(uniform(self.cosine_projector.bias.shape, bound, generator))
            self.sim_matrix.copy_(torch.randn(self.sim_matrix.shape, generator=generator, dtype=torch.float64) * 0.01)
            self.temperature.fill_(math.log(1.0 / self.init_t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj, sim, temperature = self.cosine_projector, self.sim_matrix, self.temperature
        if self.fp32_gate:
            x = x.float()
            projected = F.linear(x, proj.weight.float(), proj.bias.float())
            sim, temperature = sim.float(), temperature.float()
        else:
            projected = proj(x.to(proj.weight.dtype))
        logits = F.normalize(projected, dim=1) @ F.normalize(sim, dim=0)
        return logits * temperature.clamp(max=self.clamp_max).exp()



def make_gate(spec: dict[str, Any] | torch.nn.Module, model_dim: int, num_experts: int) -> torch.nn.Module:
    """A gate from one of Tutel's gate_type dictionaries, or a user's gate module."""
    if isinstance(spec, torch.nn.Module):
        return custom_gate(spec, num_experts)
    if not isinstance(spec, dict):
        raise TypeError(f"gate_type must be a dict such as {{'type': 'top', 'k': 2}} or a gate module, got "
                        f"{type(spec).__name__}")
    unknown = set(spec) - _GATE_KEYS
    if unknown:
        raise ValueError(f"gate_type: unknown keys {sorted(unknown)}; known: {sorted(_GATE_KEYS)}")
    kind = spec.get("type", "top")
    k = spec.get("k", 2)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"gate_type: k must be a positive integer, got {k!r}")
    options = {key: value for key, value in spec.items() if key != "type"}
    options["k"] = min(k, num_experts)  # as Tutel: k above E means E
    if kind == "top":
        if set(options) - {"k", "capacity_factor", "gate_noise", "fp32_gate", "z_loss_coef"}:
            raise ValueError(f"gate_type 'top' takes no {sorted(set(options) & {'proj_dim', 'init_t'})}")
        return LinearTopKGate(model_dim, num_experts, **options)
    if kind == "cosine_top":
        return CosineTopKGate(model_dim, num_experts, **options)
    raise ValueError(f"gate_type: unknown type {kind!r}; expected 'top' or 'cosine_top'")


BUILT_IN = (LinearTopKGate, CosineTopKGate)


def initialize_gate(gate: torch.nn.Module, generator: torch.Generator) -> None:
    """A built-in gate's parameters drawn from `generator`; a user's gate keeps its own."""
    if isinstance(gate, BUILT_IN):
        gate.reset_parameters(generator)


@dataclass
class GateDecision:
    """One call's routing decision for the local tokens."""

    scores: torch.Tensor  # (T, E) softmax of the (noisy) logits
    indices: torch.Tensor  # (T, k) int64 experts, best first
    gates: torch.Tensor  # (T, k) weights of the choices
    l_aux: torch.Tensor  # scalar auxiliary loss


def decide(gate: torch.nn.Module, x: torch.Tensor, top_k: int, *, training: bool, normalize_gate: bool,
           is_gshard_loss: bool) -> GateDecision:
    """The gate's logits -> scores, top-k choices, gates and auxiliary loss."""
    logits = gate(x) if isinstance(gate, BUILT_IN) else checked_logits(gate, x)
    noisy = logits
    if training and gate.gate_noise > 0:
        noisy = logits + torch.randn_like(logits) * (gate.gate_noise / logits.shape[1])
    scores, indices, gates, l_aux = top_k_gating(noisy, top_k, normalize_gate, is_gshard_loss)  # one autograd node
    if not is_gshard_loss:
        l_aux = load_importance_loss(F.softmax(logits, dim=1), logits, noisy, top_k, gate.gate_noise)
    if gate.z_loss_coef:
        l_aux = l_aux + gate.z_loss_coef * z_loss(logits)
    return GateDecision(scores, indices, gates, l_aux)
