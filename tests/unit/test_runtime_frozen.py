"""Fine-tuning with part of the layer frozen (requires_grad_(False) on the
experts, or on the gate), and tokens that need no gradient: the gradients
that are asked for equal the fully trainable layer's, bitwise, and the frozen
parameters get none."""

from __future__ import annotations

import pytest

import moe_runtime

torch = pytest.importorskip("torch")

FLOWS = {"expert": {}, "expert-d2": {"a2a_ffn_overlap_degree": 2}, "dropless": {"flow": "dropless"},
         "data_centric": {"flow": "data_centric"}}


def make(comm, options):
    return moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, 16,
                                {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32},
                                comm=comm, seeds=(1, 2), **options).double()


def gradients(layer, x):
    y = layer(x)
    (y.square().sum() + y.l_aux).backward()
    return {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("flow", list(FLOWS))
@pytest.mark.parametrize("frozen", ["experts", "gates", "every parameter", "nothing, tokens without grad"])
def test_frozen_parts_get_no_gradient_and_the_rest_theirs(comm, flow, frozen):
    x = torch.randn(24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    trainable = make(comm, FLOWS[flow])
    want_x = x.clone().requires_grad_(True)
    want = gradients(trainable, want_x)
    layer = make(comm, FLOWS[flow])
    for name, parameter in layer.named_parameters():
        if frozen == "every parameter" or name.startswith(frozen):
            parameter.requires_grad_(False)
    got_x = x.clone().requires_grad_(frozen != "nothing, tokens without grad")
    got = gradients(layer, got_x)
    for name, parameter in layer.named_parameters():
        if parameter.requires_grad:
            assert torch.equal(got[name], want[name]), name
        else:
            assert got[name] is None, name
    if got_x.requires_grad:
        assert torch.equal(got_x.grad, want_x.grad)
