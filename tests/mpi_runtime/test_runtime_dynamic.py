"""The per-expert capacity flow (MoELayer(flow="dynamic")):
against the float64 reference when nothing drops (outputs and gradients),
capacities the same on every rank and following the policy over calls,
drops counted right when the capacity is bounded, and its errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from runtime_util import (
    NOTHING_DROPS,
    assert_matches,
    make_layer,
    reference,
    run_layer,
    tokens_of,
    whole_expert_cases,
    whole_expert_runs,
)

import moe_runtime
from moe_runtime.common.host_values import all_gather_values


def gathered(values, comm) -> np.ndarray:
    """(W, len(values)): every rank's values."""
    mine = np.asarray(values, dtype=np.int64)
    return all_gather_values(mine, comm).reshape(comm.size, len(mine))


def demand_of(layer, x, k) -> np.ndarray:
    """(E,) this rank's routed choices per expert, from the layer's gate."""
    indices = torch.topk(torch.softmax(layer.gates[0](x), dim=1), k, dim=1).indices
    return torch.bincount(indices.reshape(-1), minlength=layer.num_global_experts).cpu().numpy()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("k", [1, 2])
def test_dynamic_equals_the_reference_that_drops_nothing(comm, dtype, tolerance, k):
    for layer, what in whole_expert_runs(comm, "dynamic", dtype, tolerance, k):
        plan = layer.last_plan
        assert plan.dropped == 0 and (plan.r, plan.d) == (1, 1), what
        assert len(plan.capacities) == layer.num_global_experts and plan.capacity == max(plan.capacities)
        table = gathered(plan.capacities, comm)
        assert (table == table[0]).all(), f"{what}: the ranks' capacities differ: {table.tolist()}"


def test_dynamic_with_gates_at_the_dispatch(comm):
    """is_postscore=False: the gates weigh the expert inputs."""
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, flow="dynamic", is_postscore=False)
    want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS, is_postscore=False)
    assert_matches(run_layer(layer, comm, torch.float64), want, 1e-12, "dynamic, prescore")


def test_capacities_follow_the_policy_and_agree(comm):
    """Over calls with different inputs every rank holds the same capacities,
    each expert's is at least the most it got on any rank (nothing drops),
    a multiple of the granularity, and the tracker's state is the same."""
    num_experts = whole_expert_cases(comm)[-1]
    settings = moe_runtime.DynamicCapacity(margin=1.5, granularity=4, shrink_patience=2, shrink_band=0.9)
    layer = make_layer(comm, num_experts, flow=settings)
    k = layer.gates[0].top_k
    for step in range(5):
        x = tokens_of(comm.rank, torch.float64) * (1 + step) + step
        with torch.no_grad():
            layer(x)
        plan = layer.last_plan
        most = gathered(demand_of(layer, x, k), comm).max(axis=0)
        capacities = np.array(plan.capacities)
        assert plan.dropped == 0 and (capacities >= most).all(), f"step {step}: {capacities} < demand {most}"
        assert (capacities % 4 == 0).all()
        table = gathered(capacities, comm)
        assert (table == table[0]).all(), f"step {step}: the ranks' capacities differ: {table.tolist()}"
    averages = all_gather_values(layer.capacity_tracker.average, comm).reshape(comm.size, -1)
    assert (averages == averages[0]).all()
    assert 1 <= layer.capacity_tracker.changes <= 5


@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_drops_are_counted_when_the_capacity_is_bounded(comm, batch_prioritized):
    """max_factor = 0.25 bounds every expert to ceil(0.25 k T / E) rows (T the
    most tokens on any rank): each rank drops sum_e max(0, demand_e - C_e)."""
    num_experts = whole_expert_cases(comm)[0]
    settings = moe_runtime.DynamicCapacity(max_factor=0.25, granularity=1)
    layer = make_layer(comm, num_experts, flow=settings, batch_prioritized_routing=batch_prioritized)
    k = layer.gates[0].top_k
    x = tokens_of(comm.rank, torch.float64)
    with torch.no_grad():
        layer(x)
    plan = layer.last_plan
    most_tokens = x.shape[0] + 2 * (comm.size - 1 - comm.rank)  # tokens_of: 5 + 2 rank
    bound = math.ceil(0.25 * k * most_tokens / num_experts)
    demand = demand_of(layer, x, k)
    capacities = np.array(plan.capacities)
    assert (capacities <= bound).all(), f"capacities {capacities} above the bound {bound}"
    assert plan.dropped == int(np.maximum(demand - capacities, 0).sum())
    assert int(gathered([plan.dropped], comm).sum()) > 0


def test_dynamic_errors(comm):
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, flow="dynamic")
    x = tokens_of(comm.rank, torch.float64)
    with pytest.raises(ValueError, match=r"flow='dynamic'\) runs r = 1 only"):
        layer(x, adaptive_r=0)
    with pytest.raises(ValueError, match="d = 1 only"):
        layer(x, a2a_ffn_overlap_degree=2)
    for options, error, match in [
        ({"parallel_type": "data"}, ValueError, "r = 1"),
        ({"parallel_type": "adaptive:auto"}, ValueError, "nothing for the dictionary"),
        ({"flow": {"margin": 2}}, TypeError, "flow must be a name of .* or one of .*DynamicCapacity"),
    ]:  # the deprecated dynamic_capacity= and its refusals: tests/unit/test_runtime_settings.py
        options = {"flow": "dynamic", **options}
        with pytest.raises(error, match=match):
            make_layer(comm, num_experts, **options)
    if comm.size > 1:  # E = W / 2: two ranks share each expert
        with pytest.raises(ValueError, match=r"flow='dynamic'\) needs whole experts"):
            make_layer(comm, comm.size // 2, flow="dynamic")
