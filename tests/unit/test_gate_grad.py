"""a2a.gate_grad, the gates' gradient of encode, decode, permute and unpermute
(a2a_moe_gate_grad in a2a.h): against a NumPy float64 reference with dropped
choices, one capacity, per-expert capacities and the dropless layout; equal
to the gates' gradient that a2a.torch's nodes give; out=, dtypes, and the
errors, which name the shapes and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import a2a

torch = pytest.importorskip("torch")

T, K, E, M = 13, 2, 4, 6


def choices(seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)


def values(*shape, seed=1, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reference(tokens, rows, routing, indices):
    """grad[t, j] = tokens[t] . rows[row of (t, j)], 0 for a dropped choice, in float64."""
    tokens, rows = np.asarray(tokens, np.float64), np.asarray(rows, np.float64).reshape(-1, tokens.shape[1])
    locations = np.asarray(routing.locations)
    capacity = routing.capacity
    offsets = np.asarray(routing.offsets) if routing.per_expert or capacity is None else None
    grad = np.zeros(indices.shape)
    for t in range(indices.shape[0]):
        for j in range(indices.shape[1]):
            e, loc = indices[t, j], locations[t, j]
            if offsets is not None:
                kept = loc < int(offsets[e + 1] - offsets[e])
                row = int(offsets[e]) + loc
            else:
                kept = loc < capacity
                row = e * capacity + loc
            if kept:
                grad[t, j] = tokens[t] @ rows[row]
    return grad


@pytest.mark.parametrize("capacity", [2, 4, 7], ids=["drops", "some", "none"])
def test_one_capacity_against_the_reference(capacity):
    indices = choices()
    routing = a2a.route(indices, E, capacity=capacity)
    tokens, rows = values(T, M), values(E, capacity, M, seed=2)
    got = a2a.gate_grad(tokens, rows, routing)
    assert got.dtype == np.float64 and got.shape == (T, K)
    np.testing.assert_allclose(got, reference(tokens, rows, routing, indices), rtol=1e-12, atol=1e-12)
    if capacity == 2:
        assert (got == 0).any()  # dropped choices read no row


def test_per_expert_capacities_and_the_dropless_layout():
    indices = choices(3)
    tokens = values(T, M)
    ragged = a2a.route(indices, E, capacity=[1, 5, 0, 3])
    rows = values(ragged.num_rows, M, seed=4)
    np.testing.assert_allclose(a2a.gate_grad(tokens, rows, ragged), reference(tokens, rows, ragged, indices),
                               rtol=1e-12, atol=1e-12)
    x_sorted, perm = a2a.permute(tokens, indices, E)
    np.testing.assert_allclose(a2a.gate_grad(tokens, x_sorted, perm), reference(tokens, x_sorted, perm, indices),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_dtypes_within_rounding_and_a_float32_result(dtype):
    indices = torch.from_numpy(choices(5))
    routing = a2a.route(indices, E, capacity=3)
    torch_dtype = getattr(torch, dtype)
    tokens = torch.from_numpy(values(T, M)).to(torch_dtype)
    rows = torch.from_numpy(values(E, 3, M, seed=6)).to(torch_dtype)
    want = reference(tokens.double().numpy(), rows.double().numpy(), routing, indices.numpy())
    own = a2a.gate_grad(tokens, rows, routing)
    wide = a2a.gate_grad(tokens, rows, routing, dtype="float32")
    assert own.dtype == torch_dtype and wide.dtype == torch.float32
    np.testing.assert_allclose(wide.numpy(), want, rtol=1e-5, atol=1e-5)  # float32 accumulation of exact products
    np.testing.assert_allclose(own.double().numpy(), want, rtol=1e-2, atol=1e-2)


def test_equal_to_the_gates_gradient_of_a2a_torchs_encode_and_decode():
    indices = torch.from_numpy(choices(7))
    routing = a2a.route(indices, E, capacity=3)
    x = torch.from_numpy(values(T, M, dtype=np.float32))
    gates = torch.rand(T, K, generator=torch.Generator().manual_seed(8), requires_grad=True)
    rows = torch.from_numpy(values(E, 3, M, seed=9, dtype=np.float32))
    dy = torch.from_numpy(values(T, M, seed=10, dtype=np.float32))
    a2a.fast_decode(rows, routing, gates).backward(dy)
    assert torch.equal(a2a.gate_grad(dy, rows, routing), gates.grad)
    gates.grad = None
    d_rows = torch.from_numpy(values(E, 3, M, seed=11, dtype=np.float32))
    a2a.fast_encode(x, routing, gates).backward(d_rows)
    assert torch.equal(a2a.gate_grad(x, d_rows, routing), gates.grad)


def test_out_receives_the_result():
    indices = choices()
    routing = a2a.route(indices, E, capacity=3)
    tokens, rows = values(T, M, dtype=np.float32), values(E, 3, M, seed=2, dtype=np.float32)
    out = np.full((T, K), np.nan, np.float32)
    got = a2a.gate_grad(tokens, rows, routing, out=out)
    assert np.shares_memory(got, out)
    np.testing.assert_array_equal(out, a2a.gate_grad(tokens, rows, routing))
    with pytest.raises(a2a.InvalidArgumentError, match=r"out is .*float64.*expected .* 26 float32 elements"):
        a2a.gate_grad(tokens, rows, routing, out=np.empty((T, K)))


def test_bad_arguments_name_what_is_wrong():
    indices = choices()
    routing = a2a.route(indices, E, capacity=3)
    tokens, rows = values(T, M), values(E, 3, M, seed=2)
    with pytest.raises(a2a.InvalidArgumentError, match=r"dtype must be float32 or the tokens' dtype "
                                                       r"\(float64\); got 'float16'"):
        a2a.gate_grad(tokens, rows, routing, dtype="float16")
    with pytest.raises(a2a.InvalidArgumentError, match=r"dtype must be .*got 'int32'"):
        a2a.gate_grad(tokens, rows, routing, dtype="int32")
    half = torch.from_numpy(tokens).bfloat16()  # the torch fast path says it the same way
    with pytest.raises(a2a.InvalidArgumentError, match=r"tokens' dtype \(bfloat16\); got 'float16'"):
        a2a.gate_grad(half, torch.from_numpy(rows).bfloat16(), a2a.route(torch.from_numpy(indices), E, capacity=3),
                      dtype="float16")
    with pytest.raises(a2a.InvalidArgumentError, match=r"dispatched must be \(num_experts, capacity, model_dim\) = "
                                                       r"\(4, 3, M\).*shape \(4, 2, 6\)"):
        a2a.gate_grad(tokens, np.ascontiguousarray(rows[:, :2]), routing)
    with pytest.raises(a2a.InvalidArgumentError, match=r"tokens must be \(13, model_dim\).*shape \(12, 6\)"):
        a2a.gate_grad(tokens[:12], rows, routing)
    with pytest.raises(a2a.InvalidArgumentError, match=r"tokens \(.*\) and dispatched \(.*\) differ in dtype"):
        a2a.gate_grad(tokens.astype(np.float32), rows, routing)
    x_sorted, perm = a2a.permute(tokens, indices, E)
    with pytest.raises(a2a.InvalidArgumentError, match=r"dispatched must be \(26, model_dim\)"):
        a2a.gate_grad(tokens, x_sorted[:25], perm)
    with pytest.raises(TypeError, match=r"routing must be an a2a.Routing"):
        a2a.gate_grad(tokens, rows, indices)
