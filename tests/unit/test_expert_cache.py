"""ExpertCache and its policies (Deployment paper, Section VI): hand-worked traces, Belady as the bound, the storage."""

from __future__ import annotations

import random

import pytest
import torch

from moe_runtime import ExpertCache
from moe_runtime.deployment.cache_policy import POLICIES, PolicyCore, simulate


def test_paper_example_lifo_evicts_2_and_keeps_1():
    # E = 4, cache of 2, the batch needs (1, 2, 3): 1 and 2 fill the cache, both are active,
    # so LIFO evicts 2 (the last in) for 3 and keeps 1, which the next batch needs first.
    core = PolicyCore(2, "lifo")
    accesses = core.access_batch({1, 2, 3})
    assert [(a.expert, a.hit, a.evicted) for a in accesses] == [(1, False, None), (2, False, None), (3, False, 2)]
    assert set(core.slot_of) == {1, 3}
    fifo = PolicyCore(2, "fifo")
    assert fifo.access_batch({1, 2, 3})[-1].evicted == 1
    # the next batch needs (1, 2, 3) again: LIFO hits 1, FIFO misses everything
    assert [a.hit for a in core.access_batch({1, 2, 3})] == [True, False, False]
    assert [a.hit for a in fifo.access_batch({1, 2, 3})] == [False, False, False]


def test_inactive_experts_are_evicted_first():
    # 1 was inserted last, but 0 is inactive in the second batch: every paper-rule policy evicts 0
    for policy in ("lifo", "lru", "fifo"):
        core = PolicyCore(2, policy)
        core.access_batch({0, 1})
        assert core.access_batch({1, 2})[-1].evicted == 0, policy


@pytest.mark.parametrize(
    ("trace", "misses"),
    [
        # worked by hand in the comments of cache_policy.py's rules, 2 slots, one expert per batch
        ([{0}, {1}, {2}, {0}, {1}, {2}], {"fifo": 6, "lru": 6, "lifo": 5, "belady": 4}),
        ([{0}, {1}, {0}, {2}, {0}, {1}], {"fifo": 5, "lru": 4, "lifo": 4, "belady": 4}),
        # MIN: 1 2 3 (evicts 2, used after 1) 1 2 (evicts 1, never again) 3
        ([{1, 2, 3}, {1, 2, 3}], {"fifo": 6, "lru": 6, "lifo": 5, "belady": 4}),
        ([{0, 1}, {0, 1}, {2}], {"fifo": 3, "lru": 3, "lifo": 3, "belady": 3}),
    ],
)
def test_hand_worked_miss_counts(trace, misses):
    for policy, expected in misses.items():
        stats = simulate(trace, 2, policy)
        assert (stats.misses, stats.hits) == (expected, sum(map(len, trace)) - expected), policy
        assert stats.evictions == expected - 2


@pytest.mark.parametrize(("size", "slots", "repeats"), [(3, 2, 2), (5, 2, 4), (8, 3, 5), (7, 6, 3)])
def test_lifo_beats_fifo_on_repeated_serial_batches(size, slots, repeats):
    # the paper's premise: experts run in increasing id order, batch after batch. LIFO keeps the
    # first slots - 1 resident; FIFO and LRU evict each expert just before it is needed again.
    trace = [set(range(size))] * repeats
    assert simulate(trace, slots, "lifo").misses == size + (repeats - 1) * (size - slots + 1)
    assert simulate(trace, slots, "fifo").misses == size * repeats
    assert simulate(trace, slots, "lru").misses == size * repeats


def test_lifo_can_lose_to_fifo():
    # no general LIFO <= FIFO: 2 is inserted last, so LIFO evicts it for 1 and misses it again
    trace = [{0, 2}, {1}, {2}]
    assert (simulate(trace, 2, "lifo").misses, simulate(trace, 2, "fifo").misses) == (4, 3)


def test_belady_is_a_lower_bound_on_random_traces():
    rng = random.Random(12)
    for _ in range(300):
        experts = rng.randint(2, 8)
        trace = [set(rng.sample(range(experts), rng.randint(1, experts))) for _ in range(rng.randint(1, 12))]
        slots = rng.randint(1, experts)
        best = simulate(trace, slots, "belady").misses
        for policy in ("lifo", "lru", "fifo"):
            assert best <= simulate(trace, slots, policy).misses, (trace, slots, policy)


def test_every_expert_fits_means_only_cold_misses():
    trace = [{0, 2}, {1}, {3, 0}, {2, 3}]
    for policy in POLICIES:
        stats = simulate(trace, 4, policy)
        assert (stats.misses, stats.evictions, stats.requests) == (4, 0, 7)


def test_policy_errors():
    with pytest.raises(ValueError, match="num_slots=0"):
        PolicyCore(0)
    with pytest.raises(ValueError, match="policy='mru' is unknown"):
        simulate([{0}], 1, "mru")
    with pytest.raises(ValueError, match="belady.*future trace"):
        PolicyCore(2, "belady")
    core = PolicyCore(2, "belady", trace=[{0, 1}, {2}])
    with pytest.raises(ValueError, match=r"batch 0 is \[1\] but belady's trace has \[0, 1\] there"):
        core.access_batch({1})
    core.access_batch({0, 1})
    core.access_batch({2})
    with pytest.raises(ValueError, match=r"batch 2 is \[0\] but belady's trace has only 2 batches"):
        core.access_batch({0})


def _weights(experts=5, dim=6, hidden=4):
    g = torch.Generator().manual_seed(3)
    return {
        "fc1_w": torch.randn(experts, hidden, dim, generator=g),
        "fc2_w": torch.randn(experts, hidden, dim, generator=g),
        "fc1_bias": torch.randn(experts, hidden, generator=g),
        "fc2_bias": torch.randn(experts, dim, generator=g),
    }


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_slots_hold_exactly_the_fetched_experts(policy, device):
    weights = _weights()
    rng = random.Random(5)
    trace = [set(rng.sample(range(5), rng.randint(1, 3))) for _ in range(40)]
    cache = ExpertCache(3, policy, weights=weights, trace=trace, device=device)
    assert cache.pool["fc1_w"].data_ptr() != weights["fc1_w"].data_ptr()
    assert all(w.is_pinned() for w in cache.host.values()) == (device == "cuda")
    for batch in trace:
        slots = cache.fetch(batch)
        assert set(slots) == batch and len(set(slots.values())) == len(batch)
        for expert, slot in slots.items():
            for name, w in weights.items():
                # on CUDA the compute stream waits for the copies: reading here must see them
                assert torch.equal(cache.pool[name][slot].cpu(), w[expert]), (name, expert, slot)
    expected = simulate(trace, 3, policy) if policy != "belady" else None
    report = cache.report()
    per_expert = (4 * 6 + 4 * 6 + 4 + 6) * 4
    assert cache.bytes_per_expert == per_expert
    assert report["bytes_copied"] == report["misses"] * per_expert
    assert report["memory_saved"] == (5 - 3) * per_expert
    assert report["hits"] + report["misses"] == sum(map(len, trace))
    if expected is not None:
        assert (report["hits"], report["misses"]) == (expected.hits, expected.misses)


def test_host_copy_is_separate_from_the_callers_tensors():
    weights = _weights()
    cache = ExpertCache(2, weights=weights)
    weights["fc1_w"][1].zero_()
    slots = cache.fetch([1])
    assert not torch.equal(cache.pool["fc1_w"][slots[1]], weights["fc1_w"][1])


def test_storage_errors():
    with pytest.raises(ValueError, match="num_slots=0"):
        ExpertCache(0, weights=_weights())
    with pytest.raises(ValueError, match="policy='x' is unknown"):
        ExpertCache(2, "x", weights=_weights())
    with pytest.raises(ValueError, match="number of experts"):
        ExpertCache(2, weights={"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})
    cache = ExpertCache(2, weights=_weights())
    cache.fetch([0])
    with pytest.raises(ValueError, match=r"batch 1 needs 3 experts resident at once but the cache has num_slots=2"):
        cache.fetch([0, 1, 2])
    with pytest.raises(ValueError, match=r"expert ids \[5, 9\] are unknown: the cache holds experts 0..4"):
        cache.fetch([1, 5, 9])
    with pytest.raises(ValueError, match=r"expert ids \[-1\]"):
        cache.fetch([-1])
    with pytest.raises(ValueError, match=r"expert id 1.5 is not an integer"):
        cache.fetch([1.5])
    assert set(cache.fetch(torch.tensor([1, 3]))) == {1, 3}  # tensor elements are expert ids too


def test_fetch_each_serves_more_experts_than_slots_one_at_a_time():
    weights = _weights()
    cache = ExpertCache(2, "lifo", weights=weights, record=True)
    served = []
    for expert, slot in cache.fetch_each([4, 0, 2]):
        # the expert is resident while the caller uses it, before it asks for the next
        assert all(torch.equal(cache.pool[n][slot], w[expert]) for n, w in weights.items())
        served.append(expert)
    assert served == [0, 2, 4]  # increasing id, the paper's serial order
    # like simulate: the batch (0, 2, 4) on 2 slots, LIFO evicts 2 (the last in) for 4
    assert (cache.stats.misses, cache.stats.evictions) == (3, 1) and set(cache.core.slot_of) == {0, 4}
    assert cache.recorded == [frozenset({0, 2, 4})]


def test_an_unbound_cache_is_bound_later_and_rebinding_forgets_the_residents():
    cache = ExpertCache(2)
    assert not cache.bound and cache.memory_saved == 0
    with pytest.raises(RuntimeError, match="no weights yet"):
        cache.fetch([0])
    weights = _weights()
    cache.bind(weights, "cpu")
    cache.fetch([0, 1])
    changed = {name: w + 1 for name, w in weights.items()}
    cache.bind(changed, "cpu")
    slots = cache.fetch([0])
    assert cache.stats.misses == 3  # 0 is fetched again: its slot held the old weights
    assert torch.equal(cache.pool["fc1_w"][slots[0]], changed["fc1_w"][0])
