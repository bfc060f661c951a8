"""a2a.route with one capacity per expert (the ragged layout, DynaMoE's
per-expert capacity factors) on one process against the NumPy reference
(tests/reference.py): slots, counts, offsets, drops, fast_encode /
fast_decode and their autograd, pickling, and the errors for bad
capacities."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import reference as ref
from checks import raises_invalid

import a2a

# name: (T, k, E, fraction unrouted, skew, capacities: "zeros", "large", "mixed" or "tight")
CASES = {
    "top1-mixed": (64, 1, 8, 0.0, 0.5, "mixed"),
    "top2-tight": (100, 2, 6, 0.0, 0.8, "tight"),
    "top3-unrouted-mixed": (50, 3, 5, 0.25, 0.3, "mixed"),
    "all-zero": (20, 2, 4, 0.0, 0.0, "zeros"),
    "large": (30, 2, 7, 0.1, 1.0, "large"),
    "one-expert": (17, 2, 1, 0.2, 0.0, "tight"),
    "more-experts-than-tokens": (5, 2, 64, 0.0, 0.0, "mixed"),
    "many-tokens": (5000, 2, 33, 0.05, 0.3, "tight"),
}


def case(name: str, dtype: str = "int64"):
    """(indices, E, capacities) of a case; capacities drawn from its seed,
    with zeros and values above the demand among them."""
    num_tokens, top_k, num_experts, unrouted, skew, kind = CASES[name]
    indices = ref.moe_indices(name, num_tokens, top_k, num_experts, unrouted, skew).astype(dtype)
    demand = np.bincount(indices[indices >= 0].astype(np.int64), minlength=num_experts)
    rng = np.random.default_rng(len(name) * 7919 + num_tokens)
    if kind == "zeros":
        capacities = np.zeros(num_experts, dtype=np.int64)
    elif kind == "large":
        capacities = demand + rng.integers(0, 50, num_experts)
    elif kind == "tight":  # most experts overflow
        capacities = (demand * rng.uniform(0.3, 1.1, num_experts)).astype(np.int64)
    else:
        capacities = rng.integers(0, 2 * max(int(demand.max()), 1), num_experts)
        capacities[rng.integers(0, num_experts)] = 0
    return indices, num_experts, capacities.astype(np.int64)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("name", list(CASES))
def test_route_matches_reference(name, dtype):
    indices, num_experts, capacities = case(name, dtype)
    routing = a2a.route(indices, num_experts, capacity=capacities)
    expected = ref.ref_route(indices, num_experts, capacity=capacities)
    ref.assert_routing_matches(routing, expected, name)
    assert routing.num_rows == int(capacities.sum())


def test_ragged_layout_by_hand():
    """Expert e owns capacity[e] rows from offsets[e]; an expert of capacity 0
    owns none, and its choices are dropped."""
    indices = np.array([[0, 1], [0, 0], [1, 2], [2, 2]])
    routing = a2a.route(indices, 3, capacity=[2, 0, 5])
    assert ref.as_numpy(routing.offsets).tolist() == [0, 2, 2, 7]
    assert ref.as_numpy(routing.counts).tolist() == [2, 0, 3]
    assert ref.as_numpy(routing.row_map).tolist() == [[0, -1], [1, -1], [-1, 3], [2, 4]]
    assert routing.capacity.tolist() == [2, 0, 5] and routing.per_expert
    assert routing.num_rows == 7 and routing.num_dropped == 3
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    dispatched = a2a.fast_encode(x, routing)
    assert dispatched.shape == (7, 2)
    assert dispatched.tolist() == [[0, 1], [2, 3], [6, 7], [4, 5], [6, 7], [0, 0], [0, 0]]
    assert a2a.fast_decode(dispatched, routing).tolist() == [[0, 1], [2, 3], [4, 5], [12, 14]]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("name", ["top2-tight", "top3-unrouted-mixed", "large", "many-tokens"])
def test_encode_decode_match_reference(name, gated):
    indices, num_experts, capacities = case(name)
    routing = a2a.route(indices, num_experts, capacity=capacities)
    expected = ref.ref_route(indices, num_experts, capacity=capacities)
    num_tokens, top_k = indices.shape
    x = ref.moe_data(name, (num_tokens, 6), "float32")
    gates = ref.moe_gates(name, (num_tokens, top_k), "float32") if gated else None
    dispatched = a2a.fast_encode(x, routing, gates)
    np.testing.assert_array_equal(dispatched, ref.ref_encode(x, expected, gates))
    y = a2a.fast_decode(dispatched, routing, gates)
    np.testing.assert_allclose(y, ref.ref_decode(dispatched, expected, gates), rtol=1e-6, atol=1e-6)


def test_capacities_of_the_demand_drop_nothing_and_round_trip():
    """With capacity[e] = demand[e] nothing drops and encode then decode
    (gates 1) gives every token times its routed choices."""
    indices, num_experts, _ = case("top3-unrouted-mixed")
    demand = np.bincount(indices[indices >= 0], minlength=num_experts)
    routing = a2a.route(indices, num_experts, capacity=demand)
    assert routing.num_dropped == 0 and routing.num_rows == int(demand.sum())
    x = ref.moe_data("round-trip", (indices.shape[0], 5), "float64")
    y = a2a.fast_decode(a2a.fast_encode(x, routing), routing)
    np.testing.assert_allclose(y, x * (indices >= 0).sum(axis=1, keepdims=True), rtol=1e-12)


def test_capacity_array_kinds_agree():
    indices, num_experts, capacities = case("top1-mixed")
    want = a2a.route(indices, num_experts, capacity=capacities)
    for spelled in (capacities.tolist(), tuple(capacities.tolist()), capacities.astype(np.int32),
                    capacities.astype(np.uint16)):
        got = a2a.route(indices, num_experts, capacity=spelled)
        assert got.capacity.tolist() == want.capacity.tolist()
        assert ref.as_numpy(got.row_map).tolist() == ref.as_numpy(want.row_map).tolist()


def test_capacity_view_is_a_read_only_copy():
    routing = a2a.route(np.array([[0], [1]]), 2, capacity=[1, 1])
    shown = routing.capacity
    with pytest.raises(ValueError):
        shown[0] = 5
    assert routing.capacity.tolist() == [1, 1]


def test_pickle_and_repr():
    indices, num_experts, capacities = case("top2-tight")
    routing = a2a.route(indices, num_experts, capacity=capacities)
    copy = pickle.loads(pickle.dumps(routing))
    ref.assert_routing_matches(copy, ref.ref_route(indices, num_experts, capacity=capacities), "unpickled")
    assert f"capacity={capacities.tolist()}" in repr(routing) and repr(copy) == repr(routing)


def test_a_uniform_routing_is_not_per_expert():
    routing = a2a.route(np.array([[0], [1]]), 2, capacity=3)
    assert not routing.per_expert and routing.capacity == 3


@pytest.mark.parametrize(
    "capacity, fragments",
    [
        ([1, 2], ("capacity has 2 entries", "num_experts = 3")),
        ([1, -1, 2], ("capacity[1] must be >= 0", "-1")),
        ([1.0, 2, 3], ("capacity[0] must be an integer", "float")),
        (np.array([1.5, 2.0, 3.0]), ("capacity[0] must be an integer",)),
        ([True, 1, 1], ("capacity[0] must be an integer",)),
        ([1, "2", 1], ("capacity[1] must be an integer", "str")),
        (np.zeros((3, 1), dtype=np.int64), ("1-D array of one per expert", "(3, 1)")),
        ([2**62, 2**62, 2**62], ("sum to", "2**63 - 1")),
        ([2**63, 0, 0], ("capacity[0]", "too large")),
    ],
)
def test_bad_capacities(capacity, fragments):
    raises_invalid(lambda: a2a.route(np.array([[0], [1]]), 3, capacity=capacity), "route", *fragments)


def test_capacities_with_capacity_setting_is_an_error():
    raises_invalid(lambda: a2a.route(np.array([[0]]), 2, capacity=[1, 1], capacity_setting=1.0), "either capacity")


def test_per_expert_dispatched_shape_is_checked():
    routing = a2a.route(np.array([[0], [1]]), 2, capacity=[1, 2])
    raises_invalid(lambda: a2a.fast_decode(np.zeros((2, 1, 4), np.float32), routing),
                   "fast_decode", "(num_rows, model_dim) = (3, M)")
    raises_invalid(lambda: a2a.fast_decode(np.zeros((4, 4), np.float32), routing), "fast_decode", "(3, M)")


# ---------------------------------------------------------------------------
# torch: the same routing on tensors, and autograd.

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch


def test_torch_indices_and_capacities():
    indices, num_experts, capacities = case("top3-unrouted-mixed")
    routing = a2a.route(torch.from_numpy(indices), num_experts, capacity=torch.from_numpy(capacities))
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, capacity=capacities), "torch")
    assert isinstance(routing.offsets, torch.Tensor)


def _tensor_case():
    indices, num_experts, capacities = case("top2-tight")
    indices, capacities = indices[:12], capacities.copy()
    capacities[0] = 0  # an expert without rows
    routing = a2a.route(torch.from_numpy(indices), num_experts, capacity=capacities)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(12, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    gates = torch.rand(12, 2, dtype=torch.float64, generator=generator, requires_grad=True)
    return routing, x, gates


def test_gradcheck_encode_and_decode():
    routing, x, gates = _tensor_case()
    assert routing.num_dropped > 0  # dropped choices are in the gradient too
    assert torch.autograd.gradcheck(lambda x, g: a2a_torch.fast_encode(x, routing, g), (x, gates), eps=1e-6, atol=1e-7)
    dispatched = torch.randn(routing.num_rows, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d, g: a2a_torch.fast_decode(d, routing, g), (dispatched, gates),
                                    eps=1e-6, atol=1e-7)


def test_round_trip_gradient_matches_dense_torch():
    """decode(f(encode(x))) with f elementwise: the gradient of x and the
    gates equals that of the same computation by plain torch indexing."""
    routing, x, gates = _tensor_case()
    y = a2a_torch.fast_decode(torch.tanh(a2a_torch.fast_encode(x, routing)), routing, gates)
    y.square().sum().backward()
    row_map = routing.row_map
    kept = (row_map >= 0).double()
    x2, g2 = x.detach().clone().requires_grad_(), gates.detach().clone().requires_grad_()
    y2 = (torch.tanh(x2)[:, None, :] * (g2 * kept)[:, :, None]).sum(dim=1)
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(gates.grad, g2.grad)
