"""MoELayer against the float64 reference, for every valid r, d in {1, 2, 4},
linear and 2dh, float64 and float32, on the (W, E) pairs of the issue."""

from __future__ import annotations

import pytest
import torch
from runtime_util import (
    MODEL_DIM,
    assert_matches,
    experts_cases,
    experts_spec,
    on_device,
    random_rows,
    reference,
    run_layer,
    two_level,
)

import a2a
import moe_runtime

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def make_layer(comm, num_experts, dtype, *, k=2, capacity_factor=1.0, **options):
    layer = moe_runtime.MoELayer(
        {"type": "top", "k": k, "capacity_factor": capacity_factor}, MODEL_DIM,
        experts_spec(num_experts, comm.size), comm=comm, seeds=(11, 12), **options,
    )
    return on_device(layer, dtype)


@pytest.fixture(params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("num_experts_index", range(4))
def test_every_flow_equals_the_reference(comm, dtype, num_experts_index):
    cases = experts_cases(comm.size)
    if num_experts_index >= len(cases):
        pytest.skip("fewer expert counts for this world size")
    num_experts = cases[num_experts_index]
    layer = make_layer(comm, num_experts, dtype)
    want = reference(layer, comm, dtype, capacity_factor=1.0)
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    for r in layer.valid_rs:
        for d in (1, 2, 4):
            for algo in algos:
                what = f"E={num_experts} W={comm.size} r={r} d={d} {algo} {dtype}"
                got = run_layer(layer, comm, dtype, adaptive_r=r, a2a_ffn_overlap_degree=d, algo=algo)
                assert_matches(got, want, TOLERANCE[dtype], what)
                assert layer.last_plan.capacity == want[5], what


@pytest.mark.parametrize("capacity_factor", [0.0, -0.5, 0.5, 2.0])
def test_capacity_factors(comm, capacity_factor):
    num_experts = experts_cases(comm.size)[0]
    layer = make_layer(comm, num_experts, torch.float64)
    want = reference(layer, comm, torch.float64, capacity_factor=capacity_factor)
    for r in layer.valid_rs:
        got = run_layer(layer, comm, torch.float64, adaptive_r=r, capacity_factor=capacity_factor,
                        a2a_ffn_overlap_degree=2)
        assert_matches(got, want, 1e-12, f"f={capacity_factor} r={r}")
        assert layer.last_plan.capacity == want[5]


def test_a_worst_case_capacity_equals_the_largest(comm):
    """dropless_capacity="worst_case" at f = 0: the capacity is the largest rank's token count (5 + 2 (W - 1)
    here), read from no tensor, and the layer computes what the counted capacity computes: the reference's."""
    num_experts = experts_cases(comm.size)[0]
    layer = make_layer(comm, num_experts, torch.float64, capacity_factor=0.0, dropless_capacity="worst_case")
    want = reference(layer, comm, torch.float64, capacity_factor=0.0)
    for r in layer.valid_rs:
        for d in (1, 2):
            got = run_layer(layer, comm, torch.float64, adaptive_r=r, a2a_ffn_overlap_degree=d)
            assert_matches(got, want, 1e-12, f"worst case r={r} d={d}")
            assert layer.last_plan.capacity == 5 + 2 * (comm.size - 1)
            assert layer.last_plan.dropped == 0


@pytest.mark.parametrize("options", [{"batch_prioritized_routing": True}, {"is_postscore": False}, {"k": 1}],
                         ids=["bpr", "prescore", "top1"])
def test_routing_options(comm, options):
    num_experts = experts_cases(comm.size)[-1]
    layer_options = {key: value for key, value in options.items() if key != "k"}
    layer = make_layer(comm, num_experts, torch.float64, k=options.get("k", 2), capacity_factor=0.5,
                       **layer_options)
    want = reference(layer, comm, torch.float64, capacity_factor=0.5, **layer_options)
    for r in layer.valid_rs:
        for d in (1, 2):
            got = run_layer(layer, comm, torch.float64, adaptive_r=r, a2a_ffn_overlap_degree=d)
            assert_matches(got, want, 1e-12, f"{options} r={r} d={d}")


def test_summed_expert_gradients_and_another_activation(comm):
    """expert_gradient="sum" (no 1/W folded into the weight gradients) and an
    activation other than relu (its backward through autograd), every r, d."""
    num_experts = experts_cases(comm.size)[-1]
    layer = on_device(moe_runtime.MoELayer(
        {"type": "top", "k": 2, "capacity_factor": 1.0}, MODEL_DIM,
        experts_spec(num_experts, comm.size, activation_fn=torch.nn.functional.gelu), comm=comm, seeds=(11, 12),
        expert_gradient="sum",
    ), torch.float64)
    want = reference(layer, comm, torch.float64, capacity_factor=1.0, activation=torch.nn.functional.gelu)
    for r in layer.valid_rs:
        for d in (1, 2):
            got = run_layer(layer, comm, torch.float64, adaptive_r=r, a2a_ffn_overlap_degree=d)
            assert_matches(got, want, 1e-12, f"sum gelu r={r} d={d}")


@pytest.mark.parametrize("argument, values", [
    ("adaptive_r", lambda rank, layer: layer.valid_rs[rank % len(layer.valid_rs)]),
    ("a2a_ffn_overlap_degree", lambda rank, layer: 1 + rank % 2),
    ("algo", lambda rank, layer: ("linear", "2dh")[rank % 2]),
    ("top_k", lambda rank, layer: 1 + rank % 2),
])
def test_ranks_that_disagree_raise_on_every_rank(comm, argument, values):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    layer = make_layer(comm, experts_cases(comm.size)[0], torch.float64)
    x = on_device(torch.randn(6, MODEL_DIM, dtype=torch.float64))
    with pytest.raises(a2a.MismatchError, match=argument):
        layer(x, **{argument: values(comm.rank, layer)})
    y = layer(x)  # the layer still works afterwards
    assert y.shape == x.shape


def test_switching_r_allocates_nothing_once_every_r_has_run(comm):
    layer = make_layer(comm, experts_cases(comm.size)[-1], torch.float64)
    x = random_rows(9, comm.rank)
    configs = [(r, d) for r in layer.valid_rs for d in (1, 2)]

    def step(r, d):
        y = layer(x, adaptive_r=r, a2a_ffn_overlap_degree=d)
        (y.sum() + y.l_aux).backward()

    for r, d in configs:
        step(r, d)
    sets, buffers = layer._pool.sets_created, layer._pool.snapshot()
    assert buffers  # the big buffers live in the pool between steps
    for r, d in configs[::-1] + configs:
        step(r, d)
    assert layer._pool.sets_created == sets
    assert layer._pool.snapshot() == buffers  # the same buffers, none grown or replaced


def test_a_forward_before_the_last_backward_keeps_each_steps_buffers(comm):
    """Two forwards, then both backwards: each step's pooled buffers (the
    gathered weights and their gradients too) stay its own until its
    backward has run, at every r."""
    layer = make_layer(comm, experts_cases(comm.size)[-1], torch.float64)
    generator = torch.Generator().manual_seed(comm.rank)
    xs = [on_device(torch.randn(7 + i, MODEL_DIM, dtype=torch.float64, generator=generator)) for i in range(2)]

    def grads(x):
        return [x.grad.clone(), *(g.clone() for g in layer.gather_experts(grad=True).values())]

    for r in layer.valid_rs:
        alone = []
        for x in xs:
            layer.zero_grad(set_to_none=True)
            x = x.clone().requires_grad_(True)
            y = layer(x, adaptive_r=r, a2a_ffn_overlap_degree=2)
            (y.square().sum() + y.l_aux).backward()
            alone.append(grads(x))
        inputs = [x.clone().requires_grad_(True) for x in xs]
        losses = []
        for x in inputs:
            y = layer(x, adaptive_r=r, a2a_ffn_overlap_degree=2)
            losses.append(y.square().sum() + y.l_aux)
        for x, loss, want in zip(inputs, losses, alone):
            layer.zero_grad(set_to_none=True)
            loss.backward()
            for got, expected in zip(grads(x), want):
                assert torch.equal(got, expected), f"r={r}"


def test_switching_r_moves_no_bytes_and_trains_the_same(comm):
    num_experts = experts_cases(comm.size)[-1]
    fixed = make_layer(comm, num_experts, torch.float64)
    switching = make_layer(comm, num_experts, torch.float64)
    before = {name: (t.data_ptr(), t.detach().clone()) for name, t in switching.state_dict().items()}
    losses = {"fixed": [], "switching": []}
    x = random_rows(9, comm.rank)
    for name, layer in (("fixed", fixed), ("switching", switching)):
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for step in range(6):
            r = layer.valid_rs[step % len(layer.valid_rs)] if name == "switching" else 1
            optimizer.zero_grad()
            y = layer(x, adaptive_r=r)
            loss = y.square().mean() + 0.01 * y.l_aux
            loss.backward()
            moe_runtime.sync_shared_gradients(layer, comm)
            optimizer.step()
            losses[name].append(float(loss))
    assert losses["fixed"] == pytest.approx(losses["switching"], rel=1e-10, abs=1e-12)
    # No switch moved or replaced a parameter: same storage, and without a step, same bytes.
    for name, tensor in switching.state_dict().items():
        assert tensor.data_ptr() == before[name][0], name
    frozen = {name: t.clone() for name, t in switching.state_dict().items()}
    with torch.no_grad():
        for r in switching.valid_rs:
            switching(x, adaptive_r=r)
    for name, tensor in switching.state_dict().items():
        assert torch.equal(tensor, frozen[name]), name
