"""moe_runtime.AssignmentCache on one rank: the cache keyed by sample id, the
score, the hysteresis, the checks of sample ids, and the cached layer equal
to the uncached one bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime.deployment.assignment_cache import check_sample_ids, predicted_choices

M, H = 6, 10


def test_the_cache_is_keyed_by_sample_id():
    cache = moe_runtime.AssignmentCache()
    cache.store(np.array([7, 3]), np.array([[0, 1], [2, 3], [4, 5], [6, 7]]))  # L = 2 tokens per sample
    assert len(cache) == 2
    predicted = cache.lookup(np.array([3, 9, 7]), 2, 2)  # 9 was never seen: -1
    assert predicted.tolist() == [[4, 5], [6, 7], [-1, -1], [-1, -1], [0, 1], [2, 3]]
    assert (cache.lookup(np.array([3]), 1, 2) == -1).all()  # another L is no prediction
    assert (cache.lookup(np.array([3]), 2, 1) == -1).all()  # nor another k
    cache.store(np.array([3]), np.array([[9, 8], [7, 6]]))
    assert cache.lookup(np.array([3]), 2, 2).tolist() == [[9, 8], [7, 6]]


def test_the_least_recently_seen_samples_are_forgotten_first():
    cache = moe_runtime.AssignmentCache(max_samples=2)
    for sample in (1, 2, 1, 3):  # 2 is the least recently seen when 3 arrives
        cache.store(np.array([sample]), np.array([[sample, 0]]))
    assert len(cache) == 2
    assert cache.lookup(np.array([1, 2, 3]), 1, 2)[:, 0].tolist() == [1, -1, 3]


def test_hits_are_experts_among_the_predicted_ones_in_any_order():
    actual = np.array([[0, 1], [2, 3], [4, 5], [6, -1]])
    predicted = np.array([[1, 0], [2, 7], [-1, -1], [6, -1]])
    hit, column = predicted_choices(actual, predicted)
    assert hit.tolist() == [[True, True], [True, False], [False, False], [True, False]]  # -1 is never a hit
    assert column[hit].tolist() == [1, 0, 0, 0]


def test_the_score_is_a_bias_corrected_moving_average():
    cache = moe_runtime.AssignmentCache(decay=0.5)
    assert cache.score is None
    cache.observe(0, 0)  # no choice: nothing to learn
    assert cache.score is None
    cache.observe(3, 4)
    assert cache.score == pytest.approx(0.75)  # the first call's fraction
    cache.observe(1, 2)
    assert cache.score == pytest.approx((0.5 * 0.5 * 0.75 + 0.5 * 0.5) / (0.5 * 0.5 + 0.5))


def test_hysteresis_turns_on_at_the_high_threshold_and_off_below_the_low(comm):
    cache = moe_runtime.AssignmentCache(decay=0.0, on_threshold=0.95, off_threshold=0.85)
    assert cache.agree(comm, True) is False  # no score yet
    states = []
    for fraction in (0.9, 0.96, 0.9, 0.85, 0.84, 0.9, 0.95):
        cache.observe(round(fraction * 100), 100)
        states.append(cache.agree(comm, True))
    assert states == [False, True, True, True, False, False, True]
    assert cache.agree(comm, False) is False and cache.active  # a call without ids changes nothing


def test_sample_ids_are_checked():
    ids, per_sample = check_sample_ids(torch.tensor([5, 2, 9]), 12, 0)
    assert ids.tolist() == [5, 2, 9] and ids.dtype == np.int64 and per_sample == 4
    assert check_sample_ids([], 0, 0)[1] == 0
    for bad, error, match in [([1.0, 2.0], TypeError, "must be integers"),
                              (torch.tensor([1.0, 2.0]), TypeError, "must be integers"),
                              ([True, False], TypeError, "must be integers"),
                              (["a", "b"], TypeError, "must be integers"),
                              ([[1, 2]], ValueError, "one-dimensional"),
                              ([1, 2, 3], ValueError, "3 ids for 4 tokens"),
                              ([], ValueError, "empty but the input has 4 tokens"),
                              ([4, 1, 4, 2], ValueError, "repeats id 4")]:
        with pytest.raises(error, match=match):
            check_sample_ids(bad, 4, 0)


@pytest.mark.parametrize("options, match", [
    ({"on_threshold": 1.5}, "on_threshold"), ({"off_threshold": -0.1}, "off_threshold"),
    ({"on_threshold": 0.8, "off_threshold": 0.9}, "must not exceed"), ({"decay": 1.0}, "decay"),
    ({"max_samples": 0}, "max_samples"), ({"on_threshold": "high"}, "on_threshold")])
def test_bad_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        moe_runtime.AssignmentCache(**options)


def layer_for(comm, cache=None):
    experts = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": H}
    return moe_runtime.MoELayer({"type": "top", "k": 2}, M, experts, comm=comm, seeds=(5, 6),
                                flow=moe_runtime.Dropless(assignment_cache=cache)).double()


def step(layer, x, **call):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, **call)
    (y.square().sum() + y.l_aux).backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


def test_one_rank_cached_layer_equals_the_uncached_one(comm):
    """x (B = 4 samples, L = 3 tokens, M); predictions all wrong, half right, right."""
    cache = moe_runtime.AssignmentCache(on_threshold=0.0, off_threshold=0.0)
    plain, cached = layer_for(comm), layer_for(comm, cache)
    x = torch.randn(4, 3, M, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ids = np.array([40, 10, 30, 20])
    want = step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(step(cached, x, sample_ids=ids), want))
    assert cache.score is None and len(cache) == 4  # the cache knew no sample: no score yet
    cache.observe(1, 1)  # a score: caching is on from the next call
    actual = cache.lookup(ids, 3, 2)
    wrong = np.array([[e for e in range(4) if e not in row] for row in actual])
    for predicted, hits in ((wrong, 0), (np.stack([actual[:, 0], wrong[:, 0]], 1), 12), (actual, 24)):
        cache.store(ids, predicted)
        got = step(cached, x, sample_ids=ids)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        stats = cached.assignment_stats
        assert stats.cached and (stats.hits, stats.misses) == (hits, 24 - hits)
        assert stats.hit_rate == hits / 24 and stats.unused == 24 - hits
    step(cached, x)  # without ids: no caching, no statistics
    assert cached.assignment_stats is None
