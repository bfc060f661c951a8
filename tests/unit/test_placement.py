"""moe_runtime.deployment.placement (the Deployment paper, Section VII): the policies and
metrics against hand-worked cases, and MoELayer.place on one rank."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime import placement

# One batch with shares (0.4, 0.3, 0.2, 0.1) (the module docstring's case).
SKEWED = [[4, 3, 2, 1]]
# Experts 0 and 2 rise and fall together, as do 1 and 3; all have the same mean share.
CORRELATED = [[4, 1, 4, 1], [1, 4, 1, 4]]


def test_greedy_by_hand():
    # 0 -> rank 0; 1 -> rank 1 (0 < 0.4); 2 -> rank 1 (0.3 < 0.4); 3 -> rank 0 (rank 1 full)
    assert placement.greedy(SKEWED, 2).tolist() == [[0, 3], [1, 2]]
    assert placement.max_load(SKEWED, [[0, 1], [2, 3]]) == pytest.approx(0.7)
    assert placement.max_load(SKEWED, [[0, 3], [1, 2]]) == pytest.approx(0.5)
    # 4 ranks of 1: a permutation by load; 8 experts on 2 ranks, loads 8..1: 8+5+4+1 = 7+6+3+2 = 18
    assert placement.greedy(SKEWED, 4).tolist() == [[0], [1], [2], [3]]
    assert placement.greedy([[8, 7, 6, 5, 4, 3, 2, 1]], 2).tolist() == [[0, 3, 4, 7], [1, 2, 5, 6]]


def test_greedy_breaks_ties_to_the_smaller_id_and_rank():
    # equal loads: 0 -> r0, 1 -> r1, 2 -> r0 (tie), 3 -> r1
    assert placement.greedy([[1, 1, 1, 1]], 2).tolist() == [[0, 2], [1, 3]]
    assert placement.greedy([[1, 1, 1, 1]], 2).tolist() == placement.greedy([[5, 5, 5, 5]], 2).tolist()


def test_greedy_misses_correlation_that_anti_correlation_sees():
    # Greedy (equal means) puts 0 and 2 together: rank 0 takes 0.8 of batch 0.
    fitted = placement.greedy(CORRELATED, 2)
    assert fitted.tolist() == [[0, 2], [1, 3]]
    assert placement.max_load(CORRELATED, fitted) == pytest.approx(0.8)
    assert placement.avg_max_load(CORRELATED, fitted) == pytest.approx(0.8)
    # S_10 = -1: expert 1 costs rank 0 0.25 - 0.5 = -0.25 < 0 (empty rank 1), so it joins 0.
    s = placement.correlation(CORRELATED)
    assert s[0, 2] == pytest.approx(1.0) and s[0, 1] == pytest.approx(-1.0)
    anti = placement.anti_correlation(CORRELATED, 2)
    assert anti.tolist() == [[0, 1], [2, 3]]
    assert placement.max_load(CORRELATED, anti) == pytest.approx(0.5)
    # weight 0 is greedy
    assert placement.anti_correlation(CORRELATED, 2, weight=0.0).tolist() == fitted.tolist()


def test_metrics_by_hand():
    trace = [[6, 2, 1, 1], [1, 1, 1, 7], [0, 0, 0, 0]]  # the empty batch is skipped
    assignment = [[0, 1], [2, 3]]
    np.testing.assert_allclose(placement.rank_loads(trace, assignment), [[0.8, 0.2], [0.2, 0.8]])
    assert placement.max_load(trace, assignment) == pytest.approx(0.8)
    assert placement.avg_max_load(trace, assignment) == pytest.approx(0.8)
    assignment = [[0, 3], [1, 2]]  # (0.7, 0.3), (0.8, 0.2)
    assert placement.max_load(trace, assignment) == pytest.approx(0.8)
    assert placement.avg_max_load(trace, assignment) == pytest.approx(0.75)
    assert placement.correlation([[1, 1], [1, 1]]).tolist() == [[0.0, 0.0], [0.0, 0.0]]  # constant shares


def test_fit_and_evaluate_fits_the_first_half_and_measures_the_second():
    # First half: expert 0 hot; second half: expert 3 hot. Greedy fitted on the first
    # half pairs 0 with 3 ((0.7, 0.1, 0.1, 0.1): 0 -> r0, 1 -> r1, 2 -> r1, 3 -> r0).
    trace = [[7, 1, 1, 1]] * 3 + [[1, 1, 1, 7]] * 3
    results = placement.fit_and_evaluate(trace, 2)
    assert results["greedy"]["assignment"].tolist() == [[0, 3], [1, 2]]
    assert results["greedy"]["max_load"] == pytest.approx(0.8)
    assert results["identity"]["max_load"] == pytest.approx(0.8)
    assert results["identity"]["assignment"].tolist() == [[0, 1], [2, 3]]
    assert set(results) == {"identity", "greedy", "anti_correlation"}


def test_skewed_random_traces_are_balanced_below_identity():
    rng = np.random.default_rng(0)
    weights = np.sort(rng.pareto(1.0, 16))[::-1] + 0.01  # hot experts first: identity is the worst case
    trace = rng.poisson(weights / weights.sum() * 4096, size=(200, 16))
    results = placement.fit_and_evaluate(trace, 4)
    assert results["greedy"]["avg_max_load"] < results["identity"]["avg_max_load"]
    for name in ("greedy", "anti_correlation"):
        assert sorted(results[name]["assignment"].reshape(-1).tolist()) == list(range(16))


@pytest.mark.parametrize("trace, ranks, message", [
    ([[1, 2, 3]], 2, "cannot be split evenly"),
    ([1, 2], 1, "must be \\(batches, experts\\)"),
    ([[1, -1]], 1, "non-negative"),
    ([[0, 0]], 1, "none of its 1 batches"),
    ([[1, 2]], 0, "ranks must be a positive integer"),
])
def test_bad_traces_are_refused(trace, ranks, message):
    with pytest.raises(ValueError, match=message):
        placement.greedy(trace, ranks)


@pytest.mark.parametrize("assignment, message", [
    ([[0, 1], [2]], "must be a \\(2, 2\\) array of expert ids"),
    ([[0, 1, 2, 3]], "\\(2, 2\\)"),
    ([[0, 1], [1, 3]], "experts \\[1\\] appear more than once, experts \\[2\\] not at all"),
    ([[0, 1], [2, 4]], "must be in \\[0, 4\\)"),
    ([[0.0, 1.0], [2.0, 3.0]], "integer"),
])
def test_bad_assignments_are_refused(assignment, message):
    with pytest.raises(ValueError, match=message):
        placement.as_assignment(assignment, 4, 2)
    with pytest.raises(ValueError, match=message):
        placement.max_load([[1, 1, 1, 1]], assignment if len(assignment) == 2 else [[0, 1], [2]])


def _layer(comm, **options):
    experts = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 10}
    gate = {"type": "top", "k": 2, "capacity_factor": options.pop("capacity_factor", 1.0)}
    return moe_runtime.MoELayer(gate, 6, experts, comm=comm, seeds=(5, 6), **options).double()


def _step(layer, x, **call):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, **call)
    (y.sum() + y.l_aux).backward()
    return y.detach(), x.grad, layer.gates[0].wg.weight.grad.clone()


@pytest.mark.parametrize("flow", ["expert", "dropless"])
def test_place_on_one_rank_keeps_the_function_and_moves_the_adam_state(comm, flow):
    layer = _layer(comm, flow=flow, capacity_factor=0.5)  # f = 0.5 drops: the same choices must drop
    x = torch.randn(13, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.01)
    _step(layer, x)
    optimizer.step()
    rs = [0, 1] if flow == "expert" else [None]
    before = [_step(layer, x, adaptive_r=r) for r in rs]
    experts, grads = layer.gather_experts(), layer.gather_experts(grad=True)
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in
             layer.experts.named_parameters()}
    moved = layer.place([[2, 0, 3, 1]], optimizer)
    assert moved == moe_runtime.experts.relocation.Moved(0, 0)  # one rank: slots change, nothing is sent
    assert layer.placement.tolist() == [[2, 0, 3, 1]]
    for name, p in layer.experts.named_parameters():
        assert torch.equal(p.detach()[0], experts[name][2]) and torch.equal(p.grad[0], grads[name][2])
        assert torch.equal(optimizer.state[p]["exp_avg"][1], state[name]["exp_avg"][0])
        assert torch.equal(optimizer.state[p]["exp_avg_sq"][3], state[name]["exp_avg_sq"][1])
        assert torch.equal(optimizer.state[p]["step"], state[name]["step"])
    assert all(torch.equal(experts[k], v) for k, v in layer.gather_experts().items())  # logical order kept
    for r, want in zip(rs, before):
        for a, b in zip(_step(layer, x, adaptive_r=r), want):
            assert torch.allclose(a, b, atol=1e-13, rtol=0)
    layer.place(placement.identity(4, 1))
    assert not layer.positions.moved
    assert torch.equal(layer.experts.batched_fc1_w.detach(), experts["batched_fc1_w"])


def test_place_records_a_trace_of_logical_experts(comm):
    layer = _layer(comm)
    layer.routing_trace = []
    x = torch.randn(9, 6, dtype=torch.float64)
    layer(x)
    layer.place([[3, 2, 1, 0]])
    layer(x)
    first, second = layer.routing_trace
    assert first.sum() == 18 and np.array_equal(first, second)


def test_place_errors(comm):
    layer = _layer(comm)
    with pytest.raises(ValueError, match="rank 0: assignment must hold every expert exactly once"):
        layer.place([[0, 0, 1, 2]])
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="the optimizer does not hold the expert parameter batched_fc1_w"):
        layer.place([[0, 1, 2, 3]], other)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.state[layer.experts.batched_fc2_w]["history"] = torch.zeros(3)
    with pytest.raises(ValueError, match="optimizer state 'history' of batched_fc2_w is neither per expert"):
        layer.place([[0, 1, 2, 3]], optimizer)
    assert layer.placement.tolist() == [[0, 1, 2, 3]]  # nothing moved
    shared = moe_runtime.MoELayer({"type": "top", "k": 1}, 6, {"type": "ffn", "num_experts_per_device": -1,
                                                               "hidden_size_per_expert": 4}, comm=comm, seeds=(1, 2))
    shared.place([[0]])  # n = -1 on one rank is one whole expert: nothing shared

