"""a2a.route(..., wait=False): the fixed-capacity route that reads nothing
back. The same tables as route at that capacity for every case of
test_moe_route.py (and Batch Prioritized Routing, int32, torch); no host wait
until num_dropped is read, one at each read; a bad index not routed meanwhile and
raised, in route's words, where num_dropped is read; and its argument errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import reference as ref
from checks import raises_invalid
from test_moe_route import CASES, case_indices

import a2a


def fixed_capacity(indices, num_experts, kwargs):
    """The capacity route gives the case (one number), to route at it again without waiting."""
    return a2a.route(indices, num_experts, **kwargs).capacity


def assert_same_tables(fixed, waited, what):
    for name in ("locations", "counts", "offsets", "row_map"):
        assert np.array_equal(ref.as_numpy(getattr(fixed, name)), ref.as_numpy(getattr(waited, name))), (what, name)
    assert (fixed.capacity, fixed.num_rows, fixed.num_dropped) == (waited.capacity, waited.num_rows,
                                                                   waited.num_dropped), what


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_the_same_tables_as_route_at_that_capacity(name, dtype):
    indices, num_experts, kwargs = case_indices(name, dtype)
    capacity = fixed_capacity(indices, num_experts, kwargs)
    waited = a2a.route(indices, num_experts, capacity=capacity)
    assert_same_tables(a2a.route(indices, num_experts, capacity=capacity, wait=False), waited, name)


@pytest.mark.parametrize("name", ["top2-skewed-drops", "top4-unrouted", "fixed-1", "many-tokens"])
def test_batch_prioritized_and_torch(name):
    torch = pytest.importorskip("torch")
    indices, num_experts, kwargs = case_indices(name)
    capacity = fixed_capacity(indices, num_experts, kwargs)
    scores = np.random.default_rng(7).random((len(indices), 3))
    for idx, s in ((indices, scores), (torch.from_numpy(indices), torch.from_numpy(scores))):
        waited = a2a.route(idx, num_experts, capacity=capacity, scores=s, batch_prioritized=True)
        fixed = a2a.route(idx, num_experts, capacity=capacity, scores=s, batch_prioritized=True, wait=False)
        assert type(fixed.locations) is type(idx)
        assert_same_tables(fixed, waited, name)


def test_no_host_wait_until_num_dropped_is_read():
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    with a2a.counting() as routed:
        routing = a2a.route(indices, num_experts, capacity=5, wait=False)
        rows = a2a.fast_encode(np.ones((len(indices), 4), np.float32), routing)
    assert (routed.counters.host_waits, routed.counters.kernel_calls) == (0, 2), routed.counters
    assert "num_dropped=on the device" in repr(routing)  # repr waits for nothing
    with a2a.counting() as read:
        dropped = routing.num_dropped
    assert read.counters.host_waits == 1, read.counters  # every read: a graph's replay may change it
    assert dropped == a2a.route(indices, num_experts, capacity=5).num_dropped > 0
    assert rows.shape == (num_experts, 5, 4)


def test_a_bad_index_is_not_routed_and_raises_where_num_dropped_is_read():
    indices = np.array([[0, 1], [7, 0], [1, 9]])
    with pytest.raises(a2a.InvalidArgumentError) as waited:
        a2a.route(indices, 4, capacity=2)
    routing = a2a.route(indices, 4, capacity=2, wait=False)  # returns: nothing was read
    assert ref.as_numpy(routing.locations).tolist() == [[0, 1], [-1, 1], [0, -1]]  # first choices first
    assert ref.as_numpy(routing.counts).tolist() == [2, 2, 0, 0]
    y = a2a.fast_decode(a2a.fast_encode(np.ones((3, 2), np.float32), routing), routing)  # in bounds
    assert ref.as_numpy(y).tolist() == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]
    for _ in range(2):  # every read raises, with route's own message
        assert raises_invalid(lambda: routing.num_dropped) == str(waited.value)
    raises_invalid(lambda: pickle.dumps(routing), "indices[1, 0] = 7")


def test_a_complete_routing_pickles():
    indices, num_experts, _ = case_indices("fixed-3")
    routing = a2a.route(indices, num_experts, capacity=3, wait=False)
    copy = pickle.loads(pickle.dumps(routing))
    assert_same_tables(copy, a2a.route(indices, num_experts, capacity=3), "pickled")


@pytest.mark.parametrize("kwargs, words", [
    ({"capacity_setting": 1.0}, "got capacity_setting"),
    ({}, "got capacity_setting"),
    ({"capacity": [2, 2, 2]}, "got per-expert capacities"),
    ({"capacity": 0}, "capacity must be >= 1"),
])
def test_wait_false_needs_one_capacity(kwargs, words):
    raises_invalid(lambda: a2a.route(np.zeros((4, 1), np.int64), 3, wait=False, **kwargs), words)


def test_nan_scores_come_last_in_every_framework_and_scores_are_floats():
    torch = pytest.importorskip("torch")
    scores = np.array([np.nan, 1, np.nan, 2, -np.inf, np.inf], np.float32)
    idx = np.array([[0, 1]] * 6)
    expected = np.array([4, 2, 5, 1, 3, 0])  # inf, 2, 1, -inf, then the NaNs in token order
    for framework in (np.asarray, torch.as_tensor):
        routing = a2a.route(framework(idx), 2, capacity=6, scores=framework(scores), batch_prioritized=True)
        assert np.array_equal(ref.as_numpy(routing.locations)[:, 0], expected), framework
    for wrong in (np.array([True] * 6), np.arange(6), np.ones(6, np.complex64)):
        raises_invalid(lambda wrong=wrong: a2a.route(idx, 2, capacity=6, scores=wrong, batch_prioritized=True),
                       "route: scores must be float32, float64, float16 or bfloat16")
