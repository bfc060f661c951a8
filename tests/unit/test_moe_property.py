"""Property tests of the MoE kernels on one process: random token counts,
experts, top-k, widths, capacity rules, dtypes and frameworks, with unrouted
and dropped choices, against the NumPy reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import a2a

# derandomize: the same examples on every run (a seeded, deterministic suite).
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

try:
    import torch
except ImportError:  # the NumPy half still runs
    torch = None

FRAMEWORKS = ("numpy", "torch") if torch is not None else ("numpy",)
DTYPES = ref.MOE_DTYPES if torch is not None else ("float32", "float64", "float16")


@st.composite
def routings(draw):
    """(indices (T, k) int64, E, route kwargs with NumPy scores, reference
    slot order or None, index dtype, framework)."""
    num_tokens = draw(st.integers(0, 300))
    num_experts = draw(st.integers(1, 20))
    top_k = draw(st.integers(1, 4))
    unrouted = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    skew = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**20))
    indices = ref.moe_indices(f"prop{seed}", num_tokens, top_k, num_experts, unrouted, skew)
    rule = draw(st.sampled_from(["default", "setting", "capacity"]))
    kwargs: dict = {}
    if rule == "setting":
        # Multiples of 1/4 (positive, zero and negative): k*x*T/E is exact.
        kwargs["capacity_setting"] = draw(st.integers(-12, 12)) / 4
    elif rule == "capacity":
        kwargs["capacity"] = draw(st.integers(1, 40))
    order = None
    if draw(st.booleans()):
        # Few distinct values, so that ties are common.
        scores = np.random.default_rng(seed).integers(0, 4, size=(num_tokens, draw(st.integers(1, 3))))
        kwargs.update(
            scores=scores.astype(draw(st.sampled_from(["float32", "float64"]))), batch_prioritized=True
        )
        order = ref.ref_slot_order(scores)
    index_dtype = draw(st.sampled_from(["int32", "int64"]))
    framework = draw(st.sampled_from(FRAMEWORKS))
    return indices, num_experts, kwargs, order, index_dtype, framework


def in_framework(indices, kwargs, index_dtype, framework):
    """indices and route kwargs as `framework` arrays."""
    given = ref.to_framework(indices.astype(index_dtype), index_dtype, framework)
    if "scores" in kwargs:
        scores = kwargs["scores"]
        kwargs = {**kwargs, "scores": ref.to_framework(scores, scores.dtype.name, framework)}
    return given, kwargs


def expected_routing(indices, num_experts, kwargs, order):
    plain = {k: v for k, v in kwargs.items() if k in ("capacity", "capacity_setting")}
    return ref.ref_route(indices, num_experts, order=order, **plain)


def gate_dtype_of(gates, dtype):
    return None if gates == "none" else ("float32" if gates == "float32" else dtype)


@SETTINGS
@given(routings(), st.integers(1, 40), st.sampled_from(DTYPES), st.sampled_from(["none", "float32", "same"]))
def test_route_encode_decode(problem, model_dim, dtype, gates):
    indices, num_experts, kwargs, order, index_dtype, framework = problem
    framework = "torch" if dtype == "bfloat16" else framework
    given_indices, given_kwargs = in_framework(indices, kwargs, index_dtype, framework)

    routing = a2a.route(given_indices, num_experts, **given_kwargs)
    expected = expected_routing(indices, num_experts, kwargs, order)
    ref.assert_routing_matches(routing, expected)
    # Mass conservation: every routed choice is kept or dropped.
    routed = int((indices >= 0).sum())
    assert int(ref.as_numpy(routing.counts).sum()) + routing.num_dropped == routed
    assert routing.num_rows == num_experts * routing.capacity

    num_tokens = indices.shape[0]
    tag = f"prop-{num_tokens}-{num_experts}-{model_dim}-{dtype}-{gates}"
    x_bits = ref.moe_data(tag, (num_tokens, model_dim), dtype)
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits = None if gate_dtype is None else ref.moe_gates(tag, indices.shape, gate_dtype)
    g = None if g_bits is None else ref.to_framework(g_bits, gate_dtype, framework)

    out = a2a.fast_encode(ref.to_framework(x_bits, dtype, framework), routing, gates=g)
    assert ref.framework_of(out) == framework
    want = ref.ref_encode(x_bits, expected, g_bits, dtype=dtype, gate_dtype=gate_dtype)
    ref.assert_bitwise_equal(ref.as_numpy(out), want, "fast_encode")

    # Decode exactly on dyadic data (any summation order gives the same sum).
    d_bits = ref.moe_data(tag, (num_experts, expected.capacity, model_dim), dtype, "dyadic")
    gd_bits = None if gate_dtype is None else ref.moe_gates(tag, indices.shape, gate_dtype, "dyadic")
    gd = None if gd_bits is None else ref.to_framework(gd_bits, gate_dtype, framework)
    y = a2a.fast_decode(ref.to_framework(d_bits, dtype, framework), routing, gates=gd)
    assert ref.framework_of(y) == framework and tuple(y.shape) == (num_tokens, model_dim)
    want = ref.ref_decode(d_bits, expected, gd_bits, dtype=dtype, gate_dtype=gate_dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), ref.to_float(want, dtype))


@SETTINGS
@given(routings(), st.integers(1, 40), st.sampled_from(DTYPES), st.sampled_from(["none", "float32", "same"]))
def test_permute_unpermute(problem, model_dim, dtype, gates):
    indices, num_experts, _, _, index_dtype, framework = problem
    framework = "torch" if dtype == "bfloat16" else framework
    given_indices, _ = in_framework(indices, {}, index_dtype, framework)
    num_tokens = indices.shape[0]
    tag = f"prop-perm-{num_tokens}-{num_experts}-{model_dim}-{dtype}"
    x_bits = ref.moe_data(tag, (num_tokens, model_dim), dtype, "dyadic")

    x_sorted, perm = a2a.permute(ref.to_framework(x_bits, dtype, framework), given_indices, num_experts)
    expected = ref.ref_route(indices, num_experts, dropless=True)
    ref.assert_routing_matches(perm, expected, "perm")
    assert perm.num_dropped == 0 and perm.num_rows == int((indices >= 0).sum())
    ref.assert_bitwise_equal(
        ref.as_numpy(x_sorted), ref.ref_permute(x_bits, expected, dtype=dtype), "permute"
    )

    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits = None if gate_dtype is None else ref.moe_gates(tag, indices.shape, gate_dtype, "dyadic")
    g = None if g_bits is None else ref.to_framework(g_bits, gate_dtype, framework)
    y_sorted_bits = ref.moe_data(tag + "-y", (perm.num_rows, model_dim), dtype, "dyadic")
    y = a2a.unpermute(ref.to_framework(y_sorted_bits, dtype, framework), perm, gates=g)
    want = ref.ref_unpermute(y_sorted_bits, expected, g_bits, dtype=dtype, gate_dtype=gate_dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), ref.to_float(want, dtype))


@SETTINGS
@given(routings(), st.integers(1, 12))
def test_dense_gshard_formulation(problem, model_dim):
    """The sparse reference and a2a agree with GShard's dense einsums (float64)."""
    indices, num_experts, kwargs, order, index_dtype, _ = problem
    routing = a2a.route(indices.astype(index_dtype), num_experts, **kwargs)
    expected = expected_routing(indices, num_experts, kwargs, order)
    x = ref.moe_data("dense", (indices.shape[0], model_dim), "float64")
    g = ref.moe_gates("dense", indices.shape, "float64")
    mask, weights = ref.ref_dense_routing(expected, g)
    np.testing.assert_allclose(
        a2a.fast_encode(x, routing, gates=g), ref.ref_gshard_dispatch(x, weights), rtol=1e-15
    )
    out = ref.moe_data("dense-out", (num_experts, expected.capacity, model_dim), "float64")
    np.testing.assert_allclose(
        a2a.fast_decode(out, routing, gates=g), ref.ref_gshard_combine(weights, out), rtol=1e-13, atol=1e-13
    )
    assert mask.sum() == int(ref.as_numpy(routing.counts).sum())
