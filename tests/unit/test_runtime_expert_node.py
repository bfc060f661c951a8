"""The expert flow's one autograd node (moe_runtime/flows/expert_node.py) on
one rank: a router trained alone (the experts frozen, the tokens a leaf) gets
the same gradient as in full training, and its backward runs no expert
matmul; gates applied at the encode (is_postscore=False) differentiate as
the autograd of a2a.torch's own nodes does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import a2a
import moe_runtime
from moe_runtime.bench.dispatched import DispatchedOps

T, M, H = 24, 16, 12


def layer_of(comm, **options):
    gate = {"type": "top", "k": 2, "capacity_factor": 0.75}  # some choices dropped
    experts = {"type": "ffn", "count_per_node": 3, "hidden_size_per_expert": H}
    return moe_runtime.MoELayer(gate, M, experts, comm=comm, seeds=(1, 2), **options)


def tokens(requires_grad):
    return torch.randn(T, M, generator=torch.Generator().manual_seed(5), requires_grad=requires_grad)


def test_a_router_trained_alone_gets_full_trainings_gradient_and_runs_no_expert_matmul(comm):
    trained = layer_of(comm)
    y = trained(tokens(True))
    (y.square().sum() + y.l_aux).backward()
    want = trained.gates[0].wg.weight.grad.clone()

    router_only = layer_of(comm)
    router_only.experts.requires_grad_(False)
    y = router_only(tokens(False))
    loss = y.square().sum() + y.l_aux
    with DispatchedOps() as ops:
        loss.backward()
    assert torch.equal(router_only.gates[0].wg.weight.grad, want)
    assert not ops.ops.keys() & {"bmm", "baddbmm", "baddbmm_"}, dict(ops.ops)


def test_gates_applied_at_the_encode_differentiate_as_a2a_torchs_nodes(comm):
    layer = layer_of(comm, is_postscore=False)
    x = tokens(True)
    y = layer(x)
    y.square().sum().backward()
    plan = layer.last_plan
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.experts.parameters()]

    # The same math through a2a.torch's encode and decode nodes, on the layer's own gate decision.
    x.grad = None
    layer.zero_grad()
    _, indices, gates, _, _ = a2a.top_k_gate(layer.gates[0].wg(x), 2, normalize=True)
    routing = a2a.route(indices, 3, capacity=plan.capacity)
    rows = a2a.fast_encode(x, routing, gates)
    experts = layer.experts
    hidden = torch.baddbmm(experts.batched_fc1_bias.unsqueeze(1), rows, experts.batched_fc1_w.transpose(1, 2))
    out = torch.bmm(torch.relu(hidden), experts.batched_fc2_w) + experts.batched_fc2_bias.unsqueeze(1)
    ref = a2a.fast_decode(out, routing)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    ref.square().sum().backward()
    for ours, theirs in zip(grads, [x.grad] + [p.grad for p in layer.experts.parameters()], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
