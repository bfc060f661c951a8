"""MoELayer on one rank: against the float64 reference for every r and d,
its bookkeeping (l_aux, last_plan, parameters, buffers) and its errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import moe_runtime

M, H = 6, 10


def layer_for(comm, **options):
    experts = {"type": "ffn", "num_experts_per_device": 3, "hidden_size_per_expert": H}
    gate = {"type": "top", "k": 2, "capacity_factor": options.pop("capacity_factor", 1.0)}
    return moe_runtime.MoELayer(gate, M, experts, comm=comm, seeds=(5, 6), **options).double()


@pytest.mark.parametrize("options", [{}, {"is_postscore": False}, {"batch_prioritized_routing": True},
                                     {"capacity_factor": 0.0}, {"capacity_factor": -0.5}])
def test_every_r_and_d_equals_the_reference(comm, options):
    layer = layer_for(comm, **options)
    flags = {k: v for k, v in options.items() if k != "capacity_factor"}
    x = torch.randn(11, M, dtype=torch.float64, requires_grad=True)
    experts = {name: t.requires_grad_(True) for name, t in layer.gather_experts().items()}
    wg = layer.gates[0].wg.weight.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    (y_ref,), (l_ref,), _ = moe_runtime.moe_reference([xr], wg, experts, top_k=2,
                                                      capacity_factor=layer.gates[0].capacity_factor, **flags)
    (y_ref.sum() + l_ref).backward()
    for r in layer.valid_rs:
        for d in (1, 2, 4):
            x.grad = None
            layer.zero_grad()
            y = layer(x, adaptive_r=r, a2a_ffn_overlap_degree=d)
            (y.sum() + y.l_aux).backward()
            assert torch.allclose(y, y_ref, atol=1e-12), (r, d)
            assert torch.allclose(x.grad, xr.grad, atol=1e-12), (r, d)
            assert torch.allclose(layer.gates[0].wg.weight.grad, wg.grad, atol=1e-12), (r, d)
            for name, grad in layer.gather_experts(grad=True).items():
                assert torch.allclose(grad, experts[name].grad, atol=1e-12), (name, r, d)


def test_dropless_equals_the_reference_without_drops(comm):
    layer = layer_for(comm, flow="dropless", capacity_factor=0.5)  # the factor is not used
    x = torch.randn(11, M, dtype=torch.float64, requires_grad=True)
    experts = {name: t.requires_grad_(True) for name, t in layer.gather_experts().items()}
    wg = layer.gates[0].wg.weight.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    (y_ref,), (l_ref,), _ = moe_runtime.moe_reference([xr], wg, experts, top_k=2, capacity_factor=1000.0)
    (y_ref.sum() + l_ref).backward()
    y = layer(x)
    (y.sum() + y.l_aux).backward()
    assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(x.grad, xr.grad, atol=1e-12)
    assert torch.allclose(layer.gates[0].wg.weight.grad, wg.grad, atol=1e-12)
    for name, grad in layer.gather_experts(grad=True).items():
        assert torch.allclose(grad, experts[name].grad, atol=1e-12), name
    assert layer.last_plan.dropped == 0


def test_plan_loss_and_shapes(comm):
    layer = layer_for(comm)
    x = torch.randn(2, 5, M, dtype=torch.float64)
    y = layer(x, a2a_ffn_overlap_degree=4)
    assert y.shape == x.shape and y.l_aux is layer.l_aux
    plan = layer.last_plan
    assert (plan.r, plan.d, plan.algo) == (1, 4, "linear")
    assert plan.capacity == 2 * int(1.0 * -(-10 // 3)) and plan.buffer_capacity % 4 == 0
    assert layer.valid_rs == [0, 1]
    assert layer(x, adaptive_r=0, a2a_ffn_overlap_degree=4).shape == x.shape
    assert layer.last_plan.d == 1  # nothing to pipeline without an exchange
    assert layer(x, adaptive_r=7).shape == x.shape and layer.last_plan.r == 1  # above s means s


def test_parameters_are_split_into_shared_and_expert(comm):
    layer = layer_for(comm)
    shared, experts = layer.shared_parameters(), layer.expert_parameters()
    assert [p is layer.gates[0].wg.weight for p in shared] == [True]
    assert len(experts) == 4 and not set(map(id, shared)) & set(map(id, experts))
    full = layer.gather_experts()
    assert {name: tuple(t.shape) for name, t in full.items()} == {
        "batched_fc1_w": (3, H, M), "batched_fc2_w": (3, H, M), "batched_fc1_bias": (3, H), "batched_fc2_bias": (3, M)}
    layer.gates[0].wg.weight.grad = None
    moe_runtime.sync_shared_gradients(layer, comm)  # a missing gradient becomes zeros
    assert torch.equal(layer.gates[0].wg.weight.grad, torch.zeros_like(layer.gates[0].wg.weight))


def test_big_buffers_are_reused_across_steps(comm):
    layer = layer_for(comm)
    x = torch.randn(16, M, dtype=torch.float64, requires_grad=True)
    for _ in range(5):
        loss = layer(x, a2a_ffn_overlap_degree=2).sum()  # the loss of the last step is alive during the next
        loss.backward()
    assert layer._pool.sets_created <= 2


def test_the_same_seeds_make_the_same_model(comm):
    a, b = layer_for(comm), layer_for(comm)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kwargs, error, match", [
    ({"experts": {"type": "ffn", "hidden_size_per_expert": 0}}, ValueError, "hidden_size"),
    ({"experts": {"type": "moe", "hidden_size_per_expert": 4}}, ValueError, "only type"),
    ({"experts": {"hidden_size_per_expert": 4, "nope": 1}}, ValueError, "unknown keys"),
    ({"experts": {"hidden_size_per_expert": 4, "num_experts_per_device": -2}}, ValueError, "multiple of 2"),
    ({"parallel_type": "adaptive:x"}, ValueError, "parallel_type"),
    ({"parallel_type": "adaptive:-1"}, ValueError, "non-negative"),
    ({"capacity_rule": "x"}, ValueError, "capacity_rule"),
    ({"expert_gradient": "x"}, ValueError, "expert_gradient"),
    ({"a2a_ffn_overlap_degree": 0}, ValueError, "positive"),
    ({"adaptive": "yes"}, TypeError, "AdaptiveDictionary"),
    ({"comm": None}, TypeError, "a2a.Comm"),
])
def test_construction_errors(comm, kwargs, error, match):
    arguments = {"experts": {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4},
                 "comm": comm, **kwargs}
    experts, the_comm = arguments.pop("experts"), arguments.pop("comm")
    with pytest.raises(error, match=match):
        moe_runtime.MoELayer({"type": "top"}, M, experts, comm=the_comm, seeds=(1, 2), **arguments)


def test_call_errors(comm):
    layer = layer_for(comm)
    x = torch.randn(4, M, dtype=torch.float64)
    for kwargs, match in [({"gate_index": 1}, "gate_index"), ({"top_k": 0}, "top_k"), ({"algo": "ring"}, "algo"),
                          ({"a2a_ffn_overlap_degree": -1}, "positive")]:
        with pytest.raises(ValueError, match=match):
            layer(x, **kwargs)
    with pytest.raises(ValueError, match="model_dim"):
        layer(torch.randn(4, M + 1, dtype=torch.float64))
