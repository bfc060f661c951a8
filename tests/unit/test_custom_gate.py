"""A user's gate (moe_runtime.gating.custom): a module given to MoELayer in
gate_type, and Tutel's {'type': 'custom', 'module': cls, ...} through
moe_runtime.moe. A custom gate computing the built-in 'top' gate's logits
gives the built-in layer's outputs and gradients bit for bit; what the layer
reads of a gate is defaulted or refused by name; bad logits are refused at
the call."""

from __future__ import annotations

import pytest
import torch

import moe_runtime
from moe_runtime import moe as tutel_moe

M, H, E = 8, 16, 4
EXPERTS = {"type": "ffn", "num_experts_per_device": E, "hidden_size_per_expert": H}


class ScaledLinearGate(torch.nn.Module):
    """logits = scale * x @ weight^T, scale 1: the 'top' gate's logits under other names."""

    def __init__(self, model_dim: int, num_global_experts: int, top_k: int = 2, **options):
        super().__init__()
        self.top_k, self.options = top_k, options
        self.weight = torch.nn.Parameter(torch.zeros(num_global_experts, model_dim))
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.scale * torch.nn.functional.linear(x, self.weight)


def tokens() -> torch.Tensor:
    return torch.randn(11, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def step(layer) -> list[torch.Tensor]:
    x = tokens().requires_grad_(True)
    y = layer(x)
    (y.square().sum() + y.l_aux).backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.experts.parameters())]


def test_a_users_gate_module_routes_as_the_builtin_gate(comm):
    builtin = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, M, EXPERTS, comm=comm,
                                   seeds=(1, 2)).double()
    gate = ScaledLinearGate(M, E).double()
    gate.capacity_factor = 1.0
    custom = moe_runtime.MoELayer(gate, M, EXPERTS, comm=comm, seeds=(1, 2)).double()
    assert custom.gates[0] is gate
    with torch.no_grad():
        gate.weight.copy_(builtin.gates[0].wg.weight)
    got, want = step(custom), step(builtin)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i}"
    torch.testing.assert_close(gate.weight.grad, builtin.gates[0].wg.weight.grad, rtol=0, atol=1e-14)
    assert gate.scale.grad is not None
    assert sorted(custom.state_dict()) == sorted([*(k.replace("gates.0.wg.weight", "gates.0.weight")
                                                    for k in builtin.state_dict()), "gates.0.scale"])


def test_what_the_layer_reads_of_a_gate_is_defaulted(comm):
    gate = ScaledLinearGate(M, E, top_k=9)
    layer = moe_runtime.MoELayer([gate, {"type": "top", "k": 1}], M, EXPERTS, comm=comm, seeds=(1, 2))
    assert (gate.top_k, gate.capacity_factor, gate.gate_noise, gate.z_loss_coef, gate.num_global_experts) == \
        (E, 0.0, 0.0, 0.0, E)
    x = tokens().float()
    assert layer(x, gate_index=0).shape == x.shape and layer(x, gate_index=1).shape == x.shape


def test_a_gate_without_top_k_or_for_other_experts_is_refused(comm):
    gate = ScaledLinearGate(M, E)
    del gate.top_k
    with pytest.raises(ValueError, match="the gate module ScaledLinearGate has top_k None"):
        moe_runtime.MoELayer(gate, M, EXPERTS, comm=comm, seeds=(1, 2))
    gate = ScaledLinearGate(M, E)
    gate.num_global_experts = 5
    with pytest.raises(ValueError, match="has num_global_experts 5, but the layer has 4 experts"):
        moe_runtime.MoELayer(gate, M, EXPERTS, comm=comm, seeds=(1, 2))


class BadGate(ScaledLinearGate):
    def __init__(self, returns):
        super().__init__(M, E)
        self.returns = returns

    def forward(self, x):
        return self.returns(x)


@pytest.mark.parametrize("returns, shown", [
    (lambda x: torch.zeros(x.shape[0], E + 1), r"\(11, 5\) torch.float32"),
    (lambda x: torch.zeros(x.shape[0] - 1, E), r"\(10, 4\) torch.float32"),
    (lambda x: torch.zeros(x.shape[0], E, dtype=torch.int64), r"\(11, 4\) torch.int64"),
    (lambda x: (torch.zeros(x.shape[0], E),), "tuple"),
])
def test_bad_logits_are_refused_at_the_call(comm, returns, shown):
    layer = moe_runtime.MoELayer(BadGate(returns), M, EXPERTS, comm=comm, seeds=(1, 2))
    with pytest.raises(ValueError, match=f"the gate BadGate returned {shown} for 11 tokens"):
        layer(tokens().float())


class TutelStyleGate(torch.nn.Module):
    """As Tutel's custom-gate example: every option by keyword, top_k among them."""

    def __init__(self, **options):
        super().__init__()
        self.model_dim, self.num_global_experts = options.pop("model_dim"), options.pop("num_global_experts")
        self.top_k = options.pop("top_k")
        self.received = options
        self.my_wg = torch.nn.Linear(self.model_dim, self.num_global_experts, bias=False)

    def forward(self, x):
        return self.my_wg(x)


def test_tutels_custom_gate_dict(monkeypatch):
    def made(**gate):
        return tutel_moe.moe_layer(gate_type={"type": "custom", "module": TutelStyleGate, "top_k": 2, **gate},
                                   model_dim=M, experts={"type": "ffn", "count_per_node": 2,
                                                         "hidden_size_per_expert": H}, seeds=(3, 4))

    layer = made()
    gate = layer.gates[0]
    assert isinstance(gate, TutelStyleGate) and gate.received == {} and gate.num_global_experts == 2
    assert (gate.top_k, gate.capacity_factor, gate.gate_noise) == (2, 1.0, 0.0)  # Tutel's defaults
    assert "gates.0.my_wg.weight" in layer.state_dict()
    assert torch.equal(made().gates[0].my_wg.weight, gate.my_wg.weight)  # seeded by Tutel's gate seed
    monkeypatch.setenv("CAP_FACTOR", "2.5")
    gate = made(gate_noise=0.5).gates[0]
    assert gate.capacity_factor == 2.5 and gate.gate_noise == 0.5 and gate.received == {"gate_noise": 0.5}
    x = torch.randn(3, 5, M)
    assert layer(x).shape == x.shape


def test_the_construction_agreement_reads_a_gate_as_the_layer_will():
    """What the layer reads of a user's gate is agreed across ranks, its defaults filled in first: an
    attribute left unset and one set to its default agree; another top_k or z_loss_coef does not."""
    from moe_runtime.common.agreement import describe
    from moe_runtime.construction import layer_fields

    def fields(**attributes):
        gate = ScaledLinearGate(M, E)
        for name, value in attributes.items():
            setattr(gate, name, value)
        return describe(layer_fields(gate, M, EXPERTS))  # as the ranks compare them

    assert fields() == fields(capacity_factor=0.0, gate_noise=0.0, z_loss_coef=0.0)
    assert fields() != fields(top_k=1)
    assert fields() != fields(z_loss_coef=0.1)
