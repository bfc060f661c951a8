"""a2a.route on one process against the NumPy reference (tests/reference.py):
Tutel's slot order and capacity rule, Batch Prioritized Routing, unrouted and
dropped choices, index dtypes and frameworks, and the errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from checks import names_choice, raises_invalid

import a2a

# name: (T, k, E, route kwargs, fraction unrouted, skew)
CASES = {
    "top1": (64, 1, 8, {}, 0.0, 0.0),
    "top2": (64, 2, 8, {}, 0.0, 0.0),
    "top2-skewed-drops": (100, 2, 6, {}, 0.0, 0.8),
    "top4-unrouted": (50, 4, 5, {}, 0.25, 0.3),
    "factor-0.5": (80, 2, 4, {"capacity_setting": 0.5}, 0.0, 0.0),
    "factor-1.25": (81, 2, 7, {"capacity_setting": 1.25}, 0.1, 0.5),
    "factor-4": (30, 3, 10, {"capacity_setting": 4.0}, 0.0, 1.0),
    "no-drop": (90, 2, 9, {"capacity_setting": 0}, 0.1, 1.0),
    "no-drop-capped": (90, 2, 9, {"capacity_setting": -1.0}, 0.0, 1.0),
    "no-drop-loose-cap": (90, 2, 9, {"capacity_setting": -8.0}, 0.0, 1.0),
    "fixed-3": (40, 2, 4, {"capacity": 3}, 0.1, 0.0),
    "fixed-large": (20, 2, 4, {"capacity": 100}, 0.0, 0.0),
    "fixed-1": (25, 3, 3, {"capacity": 1}, 0.2, 0.0),
    "one-expert": (17, 2, 1, {}, 0.2, 0.0),
    "one-token": (1, 3, 5, {}, 0.0, 0.0),
    "more-experts-than-tokens": (5, 2, 64, {}, 0.0, 0.0),
    "all-unrouted": (10, 2, 4, {}, 1.0, 0.0),
    "many-tokens": (20000, 2, 64, {"capacity_setting": 1.0}, 0.05, 0.02),
    "many-tokens-no-drop": (12345, 3, 17, {"capacity_setting": 0}, 0.0, 0.1),
}


def case_indices(name, dtype="int64"):
    num_tokens, top_k, num_experts, kwargs, unrouted, skew = CASES[name]
    indices = ref.moe_indices(name, num_tokens, top_k, num_experts, unrouted, skew).astype(dtype)
    return indices, num_experts, kwargs


@pytest.mark.parametrize("name", list(CASES))
def test_route_matches_reference(name):
    indices, num_experts, kwargs = case_indices(name)
    routing = a2a.route(indices, num_experts, **kwargs)
    expected = ref.ref_route(indices, num_experts, **kwargs)
    ref.assert_routing_matches(routing, expected, name)


def test_tutel_slot_order_by_hand():
    """All first choices take their slots before any second choice, so a full
    expert drops second choices first."""
    indices = np.array([[0, 1], [0, 0], [1, 0]])
    routing = a2a.route(indices, 2, capacity=2)
    assert ref.as_numpy(routing.locations).tolist() == [[0, 1], [1, 2], [0, 3]]
    assert ref.as_numpy(routing.counts).tolist() == [2, 2]
    assert ref.as_numpy(routing.offsets).tolist() == [0, 2, 4]
    assert ref.as_numpy(routing.row_map).tolist() == [[0, 3], [1, -1], [2, -1]]
    assert routing.capacity == 2 and routing.num_rows == 4 and routing.num_dropped == 2


def test_same_expert_twice_takes_two_slots():
    routing = a2a.route(np.array([[1, 1], [1, 0]]), 2, capacity=3)
    assert ref.as_numpy(routing.locations).tolist() == [[0, 2], [1, 0]]
    assert ref.as_numpy(routing.row_map).tolist() == [[3, 5], [4, 0]]


@pytest.mark.parametrize(
    "setting, expected",
    [
        (None, 5),  # default 1.0: ceil(2 * 1.0 * 10 / 4) = 5
        (1.0, 5),
        (0.5, 3),  # ceil(2.5)
        (2.0, 10),
        (0.1, 1),  # ceil(0.5)
        (0, 7),  # the largest demand
        (-0.5, 3),  # min(7, ceil(2.5))
        (-1.0, 5),
        (-100.0, 7),  # the cap is above the demand
    ],
)
def test_capacity_rule(setting, expected):
    # demand: expert 0: 7, expert 1: 6, expert 2: 4, expert 3: 3 (T=10, k=2, E=4)
    indices = np.array([[0, 1]] * 3 + [[0, 2]] * 2 + [[1, 0]] * 2 + [[2, 3]] * 2 + [[3, 1]])
    assert np.bincount(indices.ravel()).tolist() == [7, 6, 4, 3]
    kwargs = {} if setting is None else {"capacity_setting": setting}
    routing = a2a.route(indices, 4, **kwargs)
    assert routing.capacity == expected
    assert routing.num_rows == 4 * expected
    assert routing.num_dropped == sum(max(0, d - expected) for d in (7, 6, 4, 3))
    ref.assert_routing_matches(routing, ref.ref_route(indices, 4, capacity_setting=setting))


def test_capacity_setting_zero_never_drops():
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    routing = a2a.route(indices, num_experts, capacity_setting=0)
    assert routing.num_dropped == 0
    assert routing.capacity == int(np.bincount(indices.ravel(), minlength=num_experts).max())


def test_explicit_capacity_overrides_the_default_setting():
    indices, num_experts, _ = case_indices("top2")
    assert a2a.route(indices, num_experts, capacity=7).capacity == 7


@pytest.mark.parametrize("shape", ["1d", "2d", "2d-one-column"])
def test_batch_prioritized_order(shape):
    rng = np.random.default_rng(5)
    num_tokens, num_experts = 40, 3
    indices = rng.integers(0, num_experts, size=(num_tokens, 2))
    if shape == "1d":
        scores = rng.random(num_tokens).astype(np.float32)
    elif shape == "2d":
        scores = rng.random((num_tokens, 5)).astype(np.float32)
    else:
        scores = rng.random((num_tokens, 1)).astype(np.float32)
    routing = a2a.route(indices, num_experts, capacity=6, scores=scores, batch_prioritized=True)
    order = ref.ref_slot_order(scores)
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, capacity=6, order=order))
    plain = ref.ref_route(indices, num_experts, capacity=6)
    assert not np.array_equal(plain.locations, ref.as_numpy(routing.locations)), "the order had no effect"


def test_batch_prioritized_by_hand():
    """Token 2 has the best score, so its first choice takes slot 0."""
    indices = np.array([[0, 1], [0, 1], [0, 1]])
    scores = np.array([0.1, 0.2, 0.9], dtype=np.float32)
    routing = a2a.route(indices, 2, capacity=2, scores=scores, batch_prioritized=True)
    assert ref.as_numpy(routing.locations).tolist() == [[2, 2], [1, 1], [0, 0]]
    assert ref.as_numpy(routing.row_map).tolist() == [[-1, -1], [1, 3], [0, 2]]


def test_batch_prioritized_ties_keep_token_order():
    indices = np.zeros((6, 1), dtype=np.int64)
    scores = np.array([0.5, 0.7, 0.5, 0.7, 0.5, 0.7], dtype=np.float32)
    routing = a2a.route(indices, 1, capacity=6, scores=scores, batch_prioritized=True)
    assert ref.as_numpy(routing.locations)[:, 0].tolist() == [3, 0, 4, 1, 5, 2]
    # Equal row maxima of a (T, n) score matrix are ties too.
    scores2 = np.array([[0.1, 0.7], [0.7, 0.2], [0.3, 0.3], [0.7, 0.7]], dtype=np.float64)
    routing = a2a.route(
        np.zeros((4, 1), dtype=np.int64), 1, capacity=4, scores=scores2, batch_prioritized=True
    )
    assert ref.as_numpy(routing.locations)[:, 0].tolist() == [0, 1, 3, 2]


def test_batch_prioritized_all_ties_is_the_plain_order():
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    scores = np.ones(len(indices), dtype=np.float32)
    prioritized = a2a.route(indices, num_experts, scores=scores, batch_prioritized=True)
    ref.assert_routing_matches(prioritized, ref.ref_route(indices, num_experts))


def test_scores_without_batch_prioritized_are_ignored():
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    scores = np.linspace(0, 1, len(indices)).astype(np.float32)
    ref.assert_routing_matches(
        a2a.route(indices, num_experts, scores=scores), ref.ref_route(indices, num_experts)
    )


def test_batch_prioritized_torch_scores(torch):
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    scores = np.random.default_rng(3).random((len(indices), 4)).astype(np.float32)
    expected = ref.ref_route(indices, num_experts, order=ref.ref_slot_order(scores))
    routing = a2a.route(
        torch.from_numpy(indices), num_experts, scores=torch.from_numpy(scores), batch_prioritized=True
    )
    ref.assert_routing_matches(routing, expected)


@pytest.mark.parametrize("name", ["top2-skewed-drops", "top4-unrouted", "many-tokens"])
def test_int32_and_int64_indices_agree(name):
    indices, num_experts, kwargs = case_indices(name)
    r64 = a2a.route(indices, num_experts, **kwargs)
    r32 = a2a.route(indices.astype(np.int32), num_experts, **kwargs)
    expected = ref.ref_route(indices, num_experts, **kwargs)
    ref.assert_routing_matches(r64, expected, "int64")
    ref.assert_routing_matches(r32, expected, "int32")
    assert ref.as_numpy(r32.indices).dtype == np.int32


def test_negative_indices_are_unrouted():
    indices = np.array([[0, -1], [-1, -7], [1, 0], [-(2**31), 1]], dtype=np.int32)
    routing = a2a.route(indices, 2, capacity=2)
    assert ref.as_numpy(routing.locations).tolist() == [[0, -1], [-1, -1], [0, 1], [-1, 1]]
    assert ref.as_numpy(routing.row_map).tolist() == [[0, -1], [-1, -1], [2, 1], [-1, 3]]
    assert ref.as_numpy(routing.counts).tolist() == [2, 2]
    assert routing.num_dropped == 0
    # Unrouted choices do not count towards the capacity's T*k: T is still 4.
    assert a2a.route(indices, 2).capacity == 4  # ceil(2 * 1.0 * 4 / 2)


def test_int64_min_is_unrouted():
    indices = np.array([[np.iinfo(np.int64).min, 0]], dtype=np.int64)
    routing = a2a.route(indices, 1, capacity=1)
    assert ref.as_numpy(routing.row_map).tolist() == [[-1, 0]]


def test_no_tokens():
    routing = a2a.route(np.zeros((0, 2), dtype=np.int64), 4)
    ref.assert_routing_matches(routing, ref.ref_route(np.zeros((0, 2)), 4))
    assert routing.num_rows == 4 * routing.capacity


def test_no_tokens_no_drop():
    routing = a2a.route(np.zeros((0, 3), dtype=np.int32), 5, capacity_setting=0)
    assert routing.capacity == 0 and routing.num_rows == 0 and routing.num_dropped == 0


def test_counts_and_num_dropped_conserve_the_routed_choices():
    for name in CASES:
        indices, num_experts, kwargs = case_indices(name)
        routing = a2a.route(indices, num_experts, **kwargs)
        routed = int((indices >= 0).sum())
        assert int(ref.as_numpy(routing.counts).sum()) + routing.num_dropped == routed, name
        kept = ref.as_numpy(routing.row_map) >= 0
        assert int(kept.sum()) == int(ref.as_numpy(routing.counts).sum()), name


def test_routing_attributes_describe_the_padded_layout():
    indices, num_experts, _ = case_indices("top4-unrouted")
    routing = a2a.route(indices, num_experts, capacity=6)
    offsets = ref.as_numpy(routing.offsets)
    assert offsets.tolist() == [6 * e for e in range(num_experts + 1)]
    assert routing.num_rows == num_experts * 6 == offsets[-1]
    row_map = ref.as_numpy(routing.row_map)
    kept_rows = row_map[row_map >= 0]
    assert len(np.unique(kept_rows)) == len(kept_rows), "two choices share a row"
    experts = indices[row_map >= 0]
    locations = ref.as_numpy(routing.locations)[row_map >= 0]
    assert (kept_rows == experts * 6 + locations).all()
    assert (ref.as_numpy(routing.indices) == indices).all()


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_numpy_and_torch_agree(torch, index_dtype):
    indices, num_experts, kwargs = case_indices("top4-unrouted", index_dtype)
    from_numpy = a2a.route(indices, num_experts, **kwargs)
    from_torch = a2a.route(torch.from_numpy(indices), num_experts, **kwargs)
    for name in ("indices", "locations", "counts", "offsets", "row_map"):
        a, b = getattr(from_numpy, name), getattr(from_torch, name)
        assert isinstance(a, np.ndarray), f"numpy input: {name} is a {type(a).__name__}"
        assert isinstance(b, torch.Tensor), f"torch input: {name} is a {type(b).__name__}"
        assert b.device.type == "cpu"
        np.testing.assert_array_equal(ref.as_numpy(b), a, err_msg=name)
    for name in ("capacity", "num_dropped", "num_rows"):
        assert getattr(from_numpy, name) == getattr(from_torch, name), name


def test_routing_does_not_alias_a_later_modified_input():
    indices = np.array([[0, 1], [1, 0]], dtype=np.int64)
    routing = a2a.route(indices, 2)
    before = ref.as_numpy(routing.locations).copy()
    indices[:] = 0
    assert (ref.as_numpy(routing.locations) == before).all()


def test_non_contiguous_indices():
    """A column slice of a wider array is a valid (T, k) input or a clear error."""
    wide = ref.moe_indices("wide", 30, 4, 5)
    indices = wide[:, ::2]
    try:
        routing = a2a.route(indices, 5)
    except a2a.InvalidArgumentError as error:
        assert "contiguous" in str(error), str(error)
    else:
        ref.assert_routing_matches(routing, ref.ref_route(np.ascontiguousarray(indices), 5))


# ---------------------------------------------------------------------------
# Bad input: a2a.InvalidArgumentError (also a ValueError) saying what is wrong.


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_index_too_large(index_dtype):
    indices = np.zeros((6, 2), dtype=index_dtype)
    indices[4, 1] = 8
    message = raises_invalid(lambda: a2a.route(indices, 8), "8")
    assert names_choice(message, 4, 1), message


def test_index_too_large_in_torch(torch):
    indices = torch.zeros((3, 2), dtype=torch.int64)
    indices[2, 0] = 100
    message = raises_invalid(lambda: a2a.route(indices, 4), "100")
    assert names_choice(message, 2, 0), message


def test_first_bad_index_is_named_with_many_tokens():
    indices = ref.moe_indices("bad-many", 50000, 2, 16)
    indices[31234, 1] = 16
    message = raises_invalid(lambda: a2a.route(indices, 16))
    assert names_choice(message, 31234, 1), message


def test_zero_choices_per_token():
    raises_invalid(lambda: a2a.route(np.zeros((5, 0), dtype=np.int64), 4), "(5, 0)")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint8", "bool", "uint64"])
def test_index_dtype_rejected(dtype):
    raises_invalid(lambda: a2a.route(np.zeros((4, 2), dtype=dtype), 4), dtype)


def test_float_torch_indices_rejected(torch):
    raises_invalid(lambda: a2a.route(torch.zeros((4, 2)), 4), "float32")


@pytest.mark.parametrize("shape", [(8,), (2, 3, 2), ()])
def test_indices_must_be_2d(shape):
    raises_invalid(lambda: a2a.route(np.zeros(shape, dtype=np.int64), 4), str(shape))


@pytest.mark.parametrize("num_experts", [0, -3])
def test_num_experts_must_be_positive(num_experts):
    raises_invalid(
        lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), num_experts), "num_experts", str(num_experts)
    )


def test_capacity_and_setting_both_given():
    raises_invalid(
        lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, capacity=3, capacity_setting=1.0),
        "capacity",
        "capacity_setting",
    )


@pytest.mark.parametrize("capacity", [-1, -5])
def test_negative_capacity(capacity):
    raises_invalid(lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, capacity=capacity), str(capacity))


@pytest.mark.parametrize("setting", [float("nan"), float("inf"), float("-inf")])
def test_capacity_setting_must_be_finite(setting):
    raises_invalid(lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, capacity_setting=setting))


@pytest.mark.parametrize("capacity", [2**63, 2**70])
def test_capacity_too_large_names_the_limit(capacity):
    """Not pybind11's dump of the native signature: the limit, in words."""
    raises_invalid(
        lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, capacity=capacity),
        f"route: capacity {capacity} is too large",
        str(2**63 - 1),
    )


def test_largest_capacity_fails_in_the_core_not_in_the_binding():
    """The core's overflow names its op, as its other errors do."""
    indices = np.zeros((4, 2), dtype=np.int64)
    raises_invalid(lambda: a2a.route(indices, 4, capacity=2**63 - 1), "route: num_experts * capacity overflows int64")
    raises_invalid(lambda: a2a.route(indices, 4, capacity=2**62, wait=False),
                   "route_fixed: num_experts * capacity overflows int64 (4 * 4611686018427387904)")


@pytest.mark.parametrize("num_experts", [2**62, 2**63, 2**70])
def test_num_experts_too_large_names_the_limit(num_experts):
    indices = np.zeros((4, 2), dtype=np.int64)
    for call in (lambda: a2a.route(indices, num_experts), lambda: a2a.permute(np.ones((4, 2)), indices, num_experts)):
        message = raises_invalid(call, f"num_experts {num_experts} is too large", "the limit is")
        assert str(2**60 - 2) in message, message


def test_capacity_setting_too_large_for_a_float():
    raises_invalid(
        lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, capacity_setting=10**400),
        "capacity_setting is too large",
    )


@pytest.mark.parametrize("value", [2.0, "3", True, None], ids=["float", "str", "bool", "None"])
def test_integer_arguments_must_be_integers(value):
    indices = np.zeros((4, 2), dtype=np.int64)
    raises_invalid(lambda: a2a.route(indices, value), "num_experts must be an integer")
    if value is not None:  # capacity=None is the default
        raises_invalid(lambda: a2a.route(indices, 4, capacity=value), "capacity must be an integer")


def test_batch_prioritized_needs_scores():
    raises_invalid(lambda: a2a.route(np.zeros((4, 2), dtype=np.int64), 4, batch_prioritized=True), "scores")


@pytest.mark.parametrize("shape", [(5,), (3,), (5, 2, 1), (3, 2)])
def test_scores_of_wrong_shape(shape):
    message = raises_invalid(
        lambda: a2a.route(
            np.zeros((4, 2), dtype=np.int64), 4, scores=np.zeros(shape, np.float32), batch_prioritized=True
        ),
        "scores",
    )
    assert str(shape) in message or str(shape[0]) in message, message


def test_read_only_indices_are_fine():
    indices, num_experts, kwargs = case_indices("top2")
    indices.flags.writeable = False
    ref.assert_routing_matches(
        a2a.route(indices, num_experts, **kwargs), ref.ref_route(indices, num_experts, **kwargs)
    )


def test_non_native_byte_order_rejected():
    indices = np.zeros((4, 2), dtype=">i8")
    raises_invalid(lambda: a2a.route(indices, 4), "byte order")


def test_workspace_query_refuses_experts_whose_histograms_would_overflow():
    # C callers reach the size query directly; it must not wrap to a tiny size.
    from a2a import _C

    raises_invalid(lambda: _C.route_workspace_size((0, 0, 0), 3, 2, 2**62), "num_experts", "2^58")
    assert _C.route_workspace_size((0, 0, 0), 3, 2, 2**40) >= 2**40 * 8


@pytest.mark.parametrize("name", ["top2", "top2-skewed-drops", "factor-1.25", "no-drop", "fixed-3", "all-unrouted"])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_host_counts_are_the_counts_read_without_the_device(name, framework):
    """A waiting route knows its counts on the host: ``host_counts`` equals ``counts``, as a read-only NumPy
    array whatever the framework; permute's too. None where the route waited for nothing (wait=False) or took
    per-expert capacities. A pickled routing keeps them."""
    import pickle

    indices, num_experts, kwargs = case_indices(name)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        indices = torch.from_numpy(indices)
    routing = a2a.route(indices, num_experts, **kwargs)
    counts = np.asarray(routing.counts)
    host = routing.host_counts
    assert isinstance(host, np.ndarray) and host.dtype == np.int64 and np.array_equal(host, counts)
    assert not host.flags.writeable
    assert np.array_equal(pickle.loads(pickle.dumps(routing)).host_counts, counts)
    _, perm = a2a.permute(np.zeros((indices.shape[0], 4), dtype=np.float32), np.asarray(indices), num_experts)
    assert np.array_equal(perm.host_counts, perm.counts)
    assert a2a.route(indices, num_experts, capacity=3, wait=False).host_counts is None
    assert a2a.route(indices, num_experts, capacity=[2] * num_experts).host_counts is None
