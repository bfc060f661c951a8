"""Sample-assignment caching (MoELayer(flow=Dropless(assignment_cache=...)),
forward(sample_ids=)): bit for bit the uncached
dropless layer (output, input, gate and expert gradients) whatever the
prediction: 0%, 50%, 100% correct, unseen samples; experts that get no rows;
every rank takes the same on/off decision; the errors of bad ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_util import MODEL_DIM, on_device, run_layer, tokens_of, two_level
from test_runtime_dropless import make_layer, whole_expert_cases

import a2a
import moe_runtime
from moe_runtime.common.host_values import all_gather_values

ALWAYS = {"on_threshold": 0.0, "off_threshold": 0.0}  # on as soon as every rank has a score


def layers(comm, num_experts, dtype, k=2, **cache_options):
    """(uncached dropless layer, cached dropless layer, its cache), same weights."""
    cache = moe_runtime.AssignmentCache(**(cache_options or ALWAYS))
    plain = make_layer(comm, num_experts, dtype, k=k, flow="dropless")
    cached = make_layer(comm, num_experts, dtype, k=k, flow=moe_runtime.Dropless(assignment_cache=cache))
    return plain, cached, cache


def sample_ids(comm, offset=0):
    """One token per sample: ids distinct across ranks (they need not be)."""
    return np.arange(tokens_of(comm.rank, torch.float64).shape[0]) + 1000 * comm.rank + offset


def predictable_experts(comm, k=2) -> int:
    """The first whole-expert E with k experts besides each token's k (so
    that a wrong prediction exists): E = W does not on 2 ranks."""
    return next(e for e in whole_expert_cases(comm) if e >= 2 * k)


def wrong_experts(actual, num_experts):
    """(T, k): for each token, k distinct experts that are not among its actual ones."""
    predicted = np.empty_like(actual)
    for t, row in enumerate(actual):
        others = [e for e in range(num_experts) if e not in row]
        predicted[t] = [others[(t + j) % len(others)] for j in range(actual.shape[1])]
    return predicted


def prediction(actual, quality, num_experts):
    """A prediction of `actual` (T, k = 2) that is `quality` percent right."""
    wrong = wrong_experts(actual, num_experts)
    if quality == 0:
        return wrong
    if quality == 50:
        return np.stack([actual[:, 0], wrong[:, 0]], axis=1)
    return actual[:, ::-1].copy()  # the same experts in the other order: 100% (the order does not matter)


def assert_identical(got, want, what):
    names = ["y", "x.grad", "gate grad", None, "l_aux"]
    for name, a, b in zip(names, got, want):
        if name is not None:
            assert torch.equal(a, b), f"{what}: {name} differs from the uncached layer's"
    for name in want[3]:
        assert torch.equal(got[3][name], want[3][name]), f"{what}: grad {name} differs from the uncached layer's"


def all_ranks(comm, value):
    return all_gather_values(np.array([int(value)], dtype=np.int64), comm).tolist()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("quality", [0, 50, 100, "unseen"])
def test_cached_equals_uncached_whatever_the_prediction(comm, dtype, quality):
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    num_experts = predictable_experts(comm)
    for algo in algos:
        plain, cached, cache = layers(comm, num_experts, dtype)
        want = run_layer(plain, comm, dtype, algo=algo)
        ids = sample_ids(comm)
        first = run_layer(cached, comm, dtype, algo=algo, sample_ids=ids)  # fills the cache, uncached
        assert not cached.assignment_stats.cached and cached.assignment_stats.hits == 0
        assert_identical(first, want, f"first call {algo}")
        cache.observe(1, 1)  # a score: caching is on from the next call
        actual = cache.lookup(ids, 1, 2)
        if quality == "unseen":
            ids = sample_ids(comm, offset=500)  # no entry: every choice is corrected
        else:
            cache.store(ids, prediction(actual, quality, num_experts))
        got = run_layer(cached, comm, dtype, algo=algo, sample_ids=ids)
        stats = cached.assignment_stats
        assert stats.cached, "the predicted dispatch did not run"
        choices = actual.size
        hits = {0: 0, 50: choices // 2, 100: choices, "unseen": 0}[quality]
        assert (stats.hits, stats.misses) == (hits, choices - hits)
        assert_identical(got, want, f"{quality}% correct {algo} {dtype}")


def test_experts_without_rows_and_a_rank_without_tokens(comm):
    """k = 1 and every token to expert 0 (the other experts get no rows);
    rank 0 has no tokens. Predictions: all wrong (expert 1), then all right."""
    num_experts = whole_expert_cases(comm)[0]
    plain, cached, cache = layers(comm, num_experts, torch.float64, k=1)
    for layer in (plain, cached):
        with torch.no_grad():
            layer.gates[0].wg.weight.zero_()
            layer.gates[0].wg.weight[0].fill_(1.0)  # with positive inputs, expert 0 always wins
    count = 0 if comm.rank == 0 else 3 + comm.rank
    generator = torch.Generator().manual_seed(comm.rank)
    x = on_device(torch.rand(count, MODEL_DIM, dtype=torch.float64, generator=generator) + 0.1)
    ids = np.arange(count) + 100 * comm.rank

    def step(layer, **call):
        xi = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(xi, **call)
        (y.square().sum() + y.l_aux).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
        return [y.detach(), xi.grad, *grads]

    want = step(plain)
    for predicted_expert in (None, 1, 0):  # None: the first call fills the cache
        if predicted_expert is not None:
            cache.observe(1, 1)  # a score on every rank (rank 0 has no tokens to score): caching is on
            cache.store(ids, np.full((count, 1), predicted_expert, dtype=np.int64))
        got = step(cached, sample_ids=ids)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"predicting expert {predicted_expert}"
        stats = cached.assignment_stats
        assert stats.cached == (predicted_expert is not None)
        if predicted_expert is not None:
            assert stats.hits == (count if predicted_expert == 0 else 0)


def test_every_rank_takes_the_same_decision(comm):
    """decay 0: the score is the last call's hit fraction. Rank 0's
    predictions turn 50% right while the others' stay right: caching turns
    off on every rank (the lowest score decides), then on again at >= 0.95."""
    num_experts = predictable_experts(comm)
    plain, cached, cache = layers(comm, num_experts, torch.float64, decay=0.0, on_threshold=0.95,
                                  off_threshold=0.85)
    want = run_layer(plain, comm, torch.float64)
    ids = sample_ids(comm)
    decisions, scores = [], []
    for call in range(6):
        if call == 3 and comm.rank == 0:
            actual = cache.lookup(ids, 1, 2)
            cache.store(ids, prediction(actual, 50, num_experts))
        got = run_layer(cached, comm, torch.float64, sample_ids=ids)
        assert_identical(got, want, f"call {call}")
        decided = all_ranks(comm, cached.assignment_stats.cached)
        assert len(set(decided)) == 1, f"call {call}: the ranks decided differently: {decided}"
        decisions.append(decided[0])
        scores.append(cache.score)
    # Decided before the call from the scores after the one before: call 0: no score; 1: none yet (the
    # cache knew no sample at call 0); 2: 1.0 -> on; 3: on (rank 0 then hits 50%); 4: rank 0's
    # 0.5 < 0.85 -> off on every rank, though the others' scores are 1; 5: 1.0 -> on.
    assert decisions == [0, 0, 1, 1, 0, 1]
    assert scores == [None, 1.0, 1.0, 0.5 if comm.rank == 0 else 1.0, 1.0, 1.0]


def test_sample_id_errors_are_raised_on_every_rank(comm):
    num_experts = whole_expert_cases(comm)[0]
    plain, cached, _ = layers(comm, num_experts, torch.float64)
    x = tokens_of(comm.rank, torch.float64)
    ids = sample_ids(comm)
    with pytest.raises(ValueError, match="assignment_cache=moe_runtime.AssignmentCache"):
        plain(x, sample_ids=ids)
    bad = ids[:-1] if comm.rank == comm.size - 1 else ids  # the last rank's count does not divide its tokens
    expected = ValueError if comm.rank == comm.size - 1 or comm.size == 1 else a2a.RemoteError
    with pytest.raises(expected, match="sample_ids" if expected is ValueError else f"rank\\(s\\) {comm.size - 1}"):
        cached(x, sample_ids=bad)
    floats = ids.astype(np.float64) if comm.rank == 0 else ids
    expected = TypeError if comm.rank == 0 else a2a.RemoteError
    with pytest.raises(expected, match="must be integers" if comm.rank == 0 else "bad sample_ids"):
        cached(x, sample_ids=floats)
    if comm.size > 1:
        with pytest.raises(a2a.MismatchError, match="differ in sample_ids"):
            cached(x, sample_ids=ids if comm.rank == 0 else None)
    y = cached(x, sample_ids=ids)  # the layer still works after the errors
    assert y.shape == x.shape
    # assignment_cache= without dispatcher="dropless" (deprecated keywords): tests/unit/test_runtime_settings.py
    with pytest.raises(ValueError, match="another layer"):
        make_layer(comm, num_experts, flow=moe_runtime.Dropless(assignment_cache=cached.assignment_cache))
