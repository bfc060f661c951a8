"""fast_encode / fast_decode / permute / unpermute on one process against the
NumPy reference (tests/reference.py) and GShard's dense einsums.

Encode and permute form one product per element (float32, float64 for
float64), so they are compared bitwise. Decode and unpermute sum up to k
products, whose order and fusing (FMA) the kernels may choose: they are
compared within a rounding bound, and exactly on dyadic data, where every
product and sum is exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import reference as ref
from checks import names_choice, raises_invalid

import a2a

GATES = ("none", "float32", "same")
MODEL_DIMS = (1, 3, 8, 1000)

# name: (T, k, E, route kwargs, fraction unrouted, skew)
ROUTINGS = {
    "top1": (37, 1, 4, {}, 0.0, 0.0),
    "top2-drops-unrouted": (50, 2, 5, {"capacity_setting": 0.75}, 0.1, 0.7),
    "top3-no-drop": (29, 3, 6, {"capacity_setting": 0}, 0.2, 0.5),
    "top4-capacity-1": (16, 4, 3, {"capacity": 1}, 0.1, 0.0),
    "one-expert": (9, 2, 1, {}, 0.3, 0.0),
    "all-unrouted": (6, 2, 3, {"capacity": 2}, 1.0, 0.0),
    "no-tokens": (0, 2, 3, {"capacity": 2}, 0.0, 0.0),
}


def framework_for(dtype):
    return "torch" if dtype == "bfloat16" else "numpy"


def routing_case(name, framework="numpy"):
    """(a2a routing, reference routing, indices as passed)."""
    num_tokens, top_k, num_experts, kwargs, unrouted, skew = ROUTINGS[name]
    indices = ref.moe_indices(name, num_tokens, top_k, num_experts, unrouted, skew)
    expected = ref.ref_route(indices, num_experts, **kwargs)
    given = ref.to_framework(indices, "int64", framework)
    routing = a2a.route(given, num_experts, **kwargs)
    ref.assert_routing_matches(routing, expected, name)
    return routing, expected, given


def permute_case(name, x, framework="numpy"):
    num_tokens, top_k, num_experts, _, unrouted, skew = ROUTINGS[name]
    indices = ref.moe_indices(name, num_tokens, top_k, num_experts, unrouted, skew)
    expected = ref.ref_route(indices, num_experts, dropless=True)
    x_sorted, perm = a2a.permute(x, ref.to_framework(indices, "int64", framework), num_experts)
    ref.assert_routing_matches(perm, expected, f"{name} perm")
    return x_sorted, perm, expected


def gate_dtype_of(gates, dtype):
    return None if gates == "none" else ("float32" if gates == "float32" else dtype)


def make_gates(tag, shape, gate_dtype, framework, kind="normal"):
    if gate_dtype is None:
        return None, None
    bits = ref.moe_gates(tag, shape, gate_dtype, kind)
    return bits, ref.to_framework(bits, gate_dtype, framework)


def check_output(out, framework, dtype, shape, what):
    assert ref.framework_of(out) == framework, (
        f"{what} is a {ref.framework_of(out)} array, expected {framework}"
    )
    assert ref.dtype_name(out) == dtype, f"{what} has dtype {ref.dtype_name(out)}, expected {dtype}"
    assert tuple(out.shape) == tuple(shape), f"{what} has shape {tuple(out.shape)}, expected {shape}"


def assert_close_sum(got, rows_bits, routing, gate_bits, dtype, gate_dtype, what):
    """got (T, M) within the rounding bound of y = sum_j g_j * rows[row_j]."""
    expected = _exact_sum(rows_bits, routing, gate_bits, dtype, gate_dtype, absolute=False)
    magnitude = _exact_sum(rows_bits, routing, gate_bits, dtype, gate_dtype, absolute=True)
    actual = ref.to_float(ref.as_numpy(got), dtype)
    bound = ref.moe_tolerance(dtype, routing.top_k) * magnitude + (2.0**-24 if dtype == "float16" else 1e-300)
    error = np.abs(actual - expected)
    if not (error <= bound).all():
        t, m = np.argwhere(~(error <= bound))[0]
        raise AssertionError(
            f"{what}: {(~(error <= bound)).sum()} elements off; first [{t}, {m}]: got {actual[t, m]!r}, "
            f"expected {expected[t, m]!r} (bound {bound[t, m]:.3g})"
        )


def _exact_sum(rows_bits, routing, gate_bits, dtype, gate_dtype, absolute):
    """sum_j g_j * rows[row_j] in float64 (of magnitudes when `absolute`)."""
    rows_bits = np.asarray(rows_bits)
    rows = ref.to_float(rows_bits.reshape(routing.num_rows, rows_bits.shape[-1]), dtype)
    gates = None if gate_bits is None else ref.to_float(gate_bits, gate_dtype)
    if absolute:
        rows = np.abs(rows)
        gates = None if gates is None else np.abs(gates)
    return ref.ref_combine_rows(rows, routing, gates, dtype="float64", gate_dtype="float64")


# ---------------------------------------------------------------------------
# Fast encode / decode.


@pytest.mark.parametrize("model_dim", MODEL_DIMS)
@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_encode_matches_reference(dtype, gates, model_dim):
    framework = framework_for(dtype)
    routing, expected, _ = routing_case("top2-drops-unrouted", framework)
    tag = f"enc-{dtype}-{gates}-{model_dim}"
    x_bits = ref.moe_data(tag, (expected.num_tokens, model_dim), dtype)
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits, g = make_gates(tag, expected.row_map.shape, gate_dtype, framework)
    out = a2a.fast_encode(ref.to_framework(x_bits, dtype, framework), routing, gates=g)
    want = ref.ref_encode(x_bits, expected, g_bits, dtype=dtype, gate_dtype=gate_dtype)
    check_output(out, framework, dtype, (expected.num_experts, expected.capacity, model_dim), "dispatched")
    ref.assert_bitwise_equal(ref.as_numpy(out), want, f"fast_encode {dtype} gates={gates} M={model_dim}")


@pytest.mark.parametrize("model_dim", MODEL_DIMS)
@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_decode_matches_reference(dtype, gates, model_dim):
    framework = framework_for(dtype)
    routing, expected, _ = routing_case("top2-drops-unrouted", framework)
    tag = f"dec-{dtype}-{gates}-{model_dim}"
    # Padding rows hold data too: decode must not read them.
    d_bits = ref.moe_data(tag, (expected.num_experts, expected.capacity, model_dim), dtype)
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits, g = make_gates(tag, expected.row_map.shape, gate_dtype, framework)
    y = a2a.fast_decode(ref.to_framework(d_bits, dtype, framework), routing, gates=g)
    check_output(y, framework, dtype, (expected.num_tokens, model_dim), "y")
    assert_close_sum(y, d_bits, expected, g_bits, dtype, gate_dtype, f"fast_decode {dtype} gates={gates}")


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_decode_exact_on_dyadic_data(dtype, gates):
    framework = framework_for(dtype)
    routing, expected, _ = routing_case("top3-no-drop", framework)
    d_bits = ref.moe_data("dyadic", (expected.num_experts, expected.capacity, 5), dtype, "dyadic")
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits, g = make_gates("dyadic", expected.row_map.shape, gate_dtype, framework, "dyadic")
    y = a2a.fast_decode(ref.to_framework(d_bits, dtype, framework), routing, gates=g)
    want = ref.ref_decode(d_bits, expected, g_bits, dtype=dtype, gate_dtype=gate_dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), ref.to_float(want, dtype))


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_encode_decode_every_routing(name, framework):
    if framework == "torch":
        pytest.importorskip("torch")
    routing, expected, _ = routing_case(name, framework)
    x_bits = ref.moe_data(name, (expected.num_tokens, 6), "float32")
    g_bits, g = make_gates(name, expected.row_map.shape, "float32", framework)
    out = a2a.fast_encode(ref.to_framework(x_bits, "float32", framework), routing, gates=g)
    check_output(out, framework, "float32", (expected.num_experts, expected.capacity, 6), "dispatched")
    ref.assert_bitwise_equal(ref.as_numpy(out), ref.ref_encode(x_bits, expected, g_bits), f"{name} encode")
    y = a2a.fast_decode(out, routing, gates=g)
    check_output(y, framework, "float32", (expected.num_tokens, 6), "y")
    assert_close_sum(y, ref.as_numpy(out), expected, g_bits, "float32", "float32", f"{name} decode")


@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
@pytest.mark.parametrize("name", ["top1", "top2-drops-unrouted", "top4-capacity-1"])
def test_round_trip_with_unit_gates(name, dtype):
    """decode(encode(x)) = (number of kept choices of t) * x[t]: x itself for a
    token kept once, zeros for a token with no kept choice."""
    framework = framework_for(dtype)
    routing, expected, _ = routing_case(name, framework)
    x_bits = ref.moe_data(f"rt-{name}", (expected.num_tokens, 7), dtype, "dyadic")
    x = ref.to_framework(x_bits, dtype, framework)
    y = a2a.fast_decode(a2a.fast_encode(x, routing), routing)
    kept = (expected.row_map >= 0).sum(axis=1)
    want = kept[:, None] * ref.to_float(x_bits, dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), want)
    if name == "top1":
        once = kept == 1
        ref.assert_bitwise_equal(ref.as_numpy(y)[once], x_bits[once], "tokens kept once")
    assert (ref.to_float(ref.as_numpy(y), dtype)[kept == 0] == 0).all()


def test_round_trip_with_gates_at_encode_and_decode():
    """Gates applied at encode (Tutel's default) or at decode (is_postscore)
    give the same y."""
    routing, expected, _ = routing_case("top2-drops-unrouted")
    x = ref.moe_data("pre-post", (expected.num_tokens, 4), "float64")
    g = ref.moe_gates("pre-post", expected.row_map.shape, "float64")
    at_encode = a2a.fast_decode(a2a.fast_encode(x, routing, gates=g), routing)
    at_decode = a2a.fast_decode(a2a.fast_encode(x, routing), routing, gates=g)
    np.testing.assert_allclose(at_encode, at_decode, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "name", ["top1", "top2-drops-unrouted", "top3-no-drop", "top4-capacity-1", "one-expert"]
)
def test_dense_gshard_einsum_equals_fast_encode_decode(name):
    routing, expected, _ = routing_case(name)
    x = ref.moe_data(f"gshard-{name}", (expected.num_tokens, 5), "float64")
    g = ref.moe_gates(f"gshard-{name}", expected.row_map.shape, "float64")
    mask, weights = ref.ref_dense_routing(expected, g)
    # Dispatch without gates, combine with them (GShard), ...
    dispatched = a2a.fast_encode(x, routing)
    np.testing.assert_allclose(dispatched, ref.ref_gshard_dispatch(x, mask), rtol=1e-15, atol=0)
    expert_out = ref.moe_data(f"gshard-out-{name}", dispatched.shape, "float64")
    y = a2a.fast_decode(expert_out, routing, gates=g)
    np.testing.assert_allclose(y, ref.ref_gshard_combine(weights, expert_out), rtol=1e-13, atol=1e-13)
    # ... and the gates at dispatch: einsum of the combine weights with x.
    np.testing.assert_allclose(
        a2a.fast_encode(x, routing, gates=g), ref.ref_gshard_dispatch(x, weights), rtol=1e-15, atol=0
    )


def test_encode_with_gates_matches_float32_products_bitwise():
    routing, expected, _ = routing_case("top2-drops-unrouted")
    x = ref.moe_data("f32-products", (expected.num_tokens, 33), "float32")
    g = ref.moe_gates("f32-products", expected.row_map.shape, "float32")
    out = a2a.fast_encode(x, routing, gates=g).reshape(-1, 33)
    t, j = np.nonzero(expected.row_map >= 0)
    products = g[t, j][:, None] * x[t]  # np.float32 * np.float32
    assert products.dtype == np.float32
    ref.assert_bitwise_equal(out[expected.row_map[t, j]], products)


def test_decode_is_independent_of_padding_and_dropped_rows():
    routing, expected, _ = routing_case("top2-drops-unrouted")
    d = ref.moe_data("padding", (expected.num_experts, expected.capacity, 4), "float32")
    y = a2a.fast_decode(d, routing)
    poisoned = d.copy().reshape(-1, 4)
    used = np.zeros(expected.num_rows, dtype=bool)
    used[expected.row_map[expected.row_map >= 0]] = True
    poisoned[~used] = np.nan
    ref.assert_bitwise_equal(a2a.fast_decode(poisoned.reshape(d.shape), routing), y)


def test_encode_overwrites_nothing_it_should_not():
    """The input is not modified."""
    routing, expected, _ = routing_case("top2-drops-unrouted")
    x = ref.moe_data("const", (expected.num_tokens, 4), "float32")
    g = ref.moe_gates("const", expected.row_map.shape, "float32")
    x0, g0 = x.copy(), g.copy()
    a2a.fast_encode(x, routing, gates=g)
    a2a.fast_decode(a2a.fast_encode(x, routing), routing, gates=g)
    ref.assert_bitwise_equal(x, x0)
    ref.assert_bitwise_equal(g, g0)


def test_routing_reused_for_many_calls():
    routing, expected, _ = routing_case("top3-no-drop")
    for i in range(5):
        x = ref.moe_data(f"reuse{i}", (expected.num_tokens, 3), "float32")
        ref.assert_bitwise_equal(a2a.fast_encode(x, routing), ref.ref_encode(x, expected))


def test_large_problem_float32():
    """Enough tokens and width for every thread and vector path."""
    indices = ref.moe_indices("large", 4096, 2, 32, 0.02, 0.05)
    routing = a2a.route(indices, 32, capacity_setting=1.0)
    expected = ref.ref_route(indices, 32, capacity_setting=1.0)
    ref.assert_routing_matches(routing, expected)
    x = ref.moe_data("large", (4096, 257), "float32")
    g = ref.moe_gates("large", (4096, 2), "float32")
    out = a2a.fast_encode(x, routing, gates=g)
    ref.assert_bitwise_equal(out, ref.ref_encode(x, expected, g))
    y = a2a.fast_decode(out, routing, gates=g)
    assert_close_sum(y, out, expected, g, "float32", "float32", "large decode")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_dim", [4096, 4099])
def test_outputs_over_32_mib_take_the_streaming_path(dtype, model_dim):
    """Outputs of 32 MiB and more are written with non-temporal stores (and,
    for bfloat16 on AVX2, hand-written vector code); 4099 columns make rows
    that start at every alignment, so the scalar heads and tails run too."""
    torch = pytest.importorskip("torch")
    T, E, k = (2048 if dtype == "float32" else 4096), 8, 2  # decode's (T, M) output reaches 32 MiB too
    indices = torch.from_numpy(ref.moe_indices("stream", T, k, E, 0.02, 0.05))
    routing = a2a.route(indices, E, capacity_setting=1.0)
    assert routing.num_rows * model_dim * (4 if dtype == "float32" else 2) >= 32 << 20
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(T, model_dim, generator=generator).to(getattr(torch, dtype))
    g = torch.rand(T, k, generator=generator)
    rows = a2a.fast_encode(x, routing, gates=g).reshape(-1, model_dim)
    row_map = routing.row_map
    kept = row_map >= 0
    token = torch.arange(T).unsqueeze(1).expand(T, k)[kept]
    expected = torch.zeros_like(rows)
    expected[row_map[kept]] = (g[kept].unsqueeze(1) * x[token].float()).to(x.dtype)
    assert torch.equal(rows.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                       expected.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    y = a2a.fast_decode(rows.reshape(E, routing.capacity, model_dim), routing, gates=g)
    gathered = torch.where(kept.unsqueeze(2), rows[row_map.clamp(min=0)].float(), torch.zeros(()))
    expected_y = torch.zeros(T, model_dim)
    for j in range(k):  # from +0, choices in order, float32: the kernels' order
        expected_y = expected_y + g[:, j : j + 1] * gathered[:, j]
    assert torch.equal(y, expected_y.to(x.dtype))


# ---------------------------------------------------------------------------
# Permute / unpermute (dropless).


@pytest.mark.parametrize("model_dim", MODEL_DIMS)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_permute_matches_reference(dtype, model_dim):
    framework = framework_for(dtype)
    name = "top2-drops-unrouted"
    x_bits = ref.moe_data(f"perm-{dtype}-{model_dim}", (ROUTINGS[name][0], model_dim), dtype)
    x_sorted, perm, expected = permute_case(name, ref.to_framework(x_bits, dtype, framework), framework)
    assert perm.capacity is None and perm.num_dropped == 0
    assert perm.num_rows == int((expected.indices >= 0).sum())
    check_output(x_sorted, framework, dtype, (perm.num_rows, model_dim), "x_sorted")
    ref.assert_bitwise_equal(
        ref.as_numpy(x_sorted), ref.ref_permute(x_bits, expected, dtype=dtype), "permute"
    )


@pytest.mark.parametrize("model_dim", MODEL_DIMS)
@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_unpermute_matches_reference(dtype, gates, model_dim):
    framework = framework_for(dtype)
    name = "top3-no-drop"
    tag = f"unperm-{dtype}-{gates}-{model_dim}"
    x_bits = ref.moe_data(tag, (ROUTINGS[name][0], model_dim), dtype)
    _, perm, expected = permute_case(name, ref.to_framework(x_bits, dtype, framework), framework)
    y_bits = ref.moe_data(tag + "-y", (perm.num_rows, model_dim), dtype)
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits, g = make_gates(tag, expected.row_map.shape, gate_dtype, framework)
    y = a2a.unpermute(ref.to_framework(y_bits, dtype, framework), perm, gates=g)
    check_output(y, framework, dtype, (expected.num_tokens, model_dim), "y")
    assert_close_sum(y, y_bits, expected, g_bits, dtype, gate_dtype, f"unpermute {dtype} gates={gates}")


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_permute_unpermute_round_trip_exact(dtype, gates):
    framework = framework_for(dtype)
    name = "top4-capacity-1"
    x_bits = ref.moe_data(f"perm-rt-{dtype}", (ROUTINGS[name][0], 3), dtype, "dyadic")
    x_sorted, perm, expected = permute_case(name, ref.to_framework(x_bits, dtype, framework), framework)
    gate_dtype = gate_dtype_of(gates, dtype)
    g_bits, g = make_gates("perm-rt", expected.row_map.shape, gate_dtype, framework, "dyadic")
    y = a2a.unpermute(x_sorted, perm, gates=g)
    gate_values = np.ones(expected.row_map.shape) if g_bits is None else ref.to_float(g_bits, gate_dtype)
    gate_sum = np.where(expected.row_map >= 0, gate_values, 0).sum(axis=1)
    want = gate_sum[:, None] * ref.to_float(x_bits, dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), want)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_permute_every_routing(name):
    num_tokens = ROUTINGS[name][0]
    x = ref.moe_data(f"perm-{name}", (num_tokens, 4), "float64")
    x_sorted, perm, expected = permute_case(name, x)
    ref.assert_bitwise_equal(x_sorted, ref.ref_permute(x, expected))
    counts = ref.as_numpy(perm.counts)
    offsets = ref.as_numpy(perm.offsets)
    assert offsets.tolist() == [0, *np.cumsum(counts).tolist()]
    assert int(counts.sum()) == int((expected.indices >= 0).sum()) == perm.num_rows


def test_permute_groups_rows_by_expert_in_slot_order():
    indices = np.array([[2, 0], [0, 2], [1, -1], [2, 2]])
    x = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    x_sorted, perm = a2a.permute(x, indices, 3)
    # expert 0: t1 (choice 0), t0 (choice 1); expert 1: t2; expert 2: t0, t3, t1, t3
    assert x_sorted[:, 0].tolist() == [1, 0, 2, 0, 3, 1, 3]
    assert ref.as_numpy(perm.counts).tolist() == [2, 1, 4]
    assert ref.as_numpy(perm.offsets).tolist() == [0, 2, 3, 7]
    assert ref.as_numpy(perm.row_map).tolist() == [[3, 1], [0, 5], [2, -1], [4, 6]]


def test_permute_equals_encode_with_no_drop_capacity():
    """With capacity_setting=0 nothing drops, and encode's rows of expert e,
    minus the padding, are permute's rows of e."""
    routing, expected, indices = routing_case("top3-no-drop")
    x = ref.moe_data("perm-vs-enc", (expected.num_tokens, 3), "float32")
    dispatched = a2a.fast_encode(x, routing)
    x_sorted, perm = a2a.permute(x, indices, expected.num_experts)
    counts = ref.as_numpy(perm.counts)
    packed = np.concatenate([dispatched[e, : counts[e]] for e in range(expected.num_experts)])
    ref.assert_bitwise_equal(x_sorted, packed)


# ---------------------------------------------------------------------------
# Bad input.


@pytest.fixture(scope="module")
def case():
    """A (T=50, k=2, E=5) routing with a capacity, and matching float32 inputs."""
    routing, expected, indices = routing_case("top2-drops-unrouted")
    return SimpleNamespace(
        routing=routing,
        expected=expected,
        indices=indices,
        x=ref.moe_data("bad", (expected.num_tokens, 4), "float32"),
        d=np.zeros((expected.num_experts, expected.capacity, 4), np.float32),
    )


@pytest.fixture(scope="module")
def torch_routing(case):
    torch = pytest.importorskip("torch")
    return a2a.route(torch.from_numpy(case.indices), 5, capacity_setting=0.75)


def test_encode_x_rows_mismatch(case):
    raises_invalid(lambda: a2a.fast_encode(case.x[:-1], case.routing), "(49, 4)", "50")


@pytest.mark.parametrize("shape", [(50,), (50, 4, 1), ()])
def test_encode_x_must_be_2d(case, shape):
    raises_invalid(lambda: a2a.fast_encode(np.zeros(shape, np.float32), case.routing), str(shape))


@pytest.mark.parametrize("dtype", ["int32", "int64", "complex64", "bool"])
def test_encode_x_dtype(case, dtype):
    raises_invalid(lambda: a2a.fast_encode(np.zeros((50, 4), dtype), case.routing), dtype)


def test_encode_moves_rows_of_bytes_bit_for_bit(case):
    """uint8 rows (packed FP8 rows): copied, a multiple of 4 bytes wide, no gates."""
    rows = np.random.default_rng(3).integers(0, 256, (50, 12), dtype=np.uint8)
    moved = a2a.fast_encode(rows, case.routing)
    assert moved.dtype == np.uint8
    np.testing.assert_array_equal(moved.view(np.uint32), a2a.fast_encode(rows.view(np.float32), case.routing).view(np.uint32))
    raises_invalid(lambda: a2a.fast_encode(rows[:, :6].copy(), case.routing), "multiple of 4 bytes")
    raises_invalid(lambda: a2a.fast_encode(rows, case.routing, gates=np.ones((50, case.routing.top_k), np.float32)),
                   "take no gates")


def test_encode_int_torch_x(torch, torch_routing):
    raises_invalid(lambda: a2a.fast_encode(torch.zeros((50, 4), dtype=torch.int32), torch_routing), "int32")


@pytest.mark.parametrize("shape", [(50, 3), (50,), (49, 2), (2, 50), (50, 2, 1)])
def test_encode_gates_shape(case, shape):
    gates = np.ones(shape, np.float32)
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, gates=gates), "gates", str(shape))


@pytest.mark.parametrize("gate_dtype", ["float64", "float16", "int32", "int64"])
def test_encode_gates_dtype(case, gate_dtype):
    """Gates are float32 or the data's dtype (float32 here)."""
    gates = np.ones((50, 2), gate_dtype)
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, gates=gates), "gates", gate_dtype)


def test_half_data_with_bfloat16_gates(torch, torch_routing):
    x = torch.zeros((50, 4), dtype=torch.float16)
    gates = torch.ones((50, 2), dtype=torch.bfloat16)
    raises_invalid(lambda: a2a.fast_encode(x, torch_routing, gates=gates), "bfloat16")


def test_float64_data_with_float16_gates(case):
    gates = np.ones((50, 2), np.float16)
    d = np.zeros(case.d.shape)
    raises_invalid(lambda: a2a.fast_decode(d, case.routing, gates=gates), "float16")
    raises_invalid(lambda: a2a.fast_encode(case.x.astype(np.float64), case.routing, gates=gates), "float16")


@pytest.mark.parametrize("delta", [(1, 0, 0), (0, 1, 0), (0, -1, 0), (-1, 0, 0)])
def test_decode_dispatched_shape(case, delta):
    shape = tuple(s + t for s, t in zip(case.d.shape, delta))
    raises_invalid(lambda: a2a.fast_decode(np.zeros(shape, np.float32), case.routing), str(shape))


def test_decode_dispatched_must_be_3d(case):
    flat = np.zeros((case.expected.num_rows, 4), np.float32)
    try:
        y = a2a.fast_decode(flat, case.routing)
    except a2a.InvalidArgumentError as error:
        assert str(flat.shape) in str(error), str(error)
    else:  # accepted as the (E*C, M) view of the same buffer
        ref.assert_bitwise_equal(y, a2a.fast_decode(case.d, case.routing))


def test_decode_dtype(case):
    raises_invalid(lambda: a2a.fast_decode(case.d.astype(np.int32), case.routing), "int32")


def test_decode_gates_shape(case):
    gates = np.ones((50, 1), np.float32)
    raises_invalid(lambda: a2a.fast_decode(case.d, case.routing, gates=gates), "gates", "(50, 1)")


def test_encode_needs_a_capacity(case):
    """A dropless routing (from permute) has no (E, C, M) layout."""
    _, perm = a2a.permute(case.x, case.indices, case.expected.num_experts)
    raises_invalid(lambda: a2a.fast_encode(case.x, perm), "dropless")


def test_routing_argument_type(case):
    with pytest.raises(TypeError, match="^fast_encode: routing must be an a2a.Routing"):
        a2a.fast_encode(case.x, case.indices)
    x_sorted, _ = a2a.permute(case.x, case.indices, 5)
    with pytest.raises(TypeError, match="^unpermute: perm must be an a2a.Routing"):
        a2a.unpermute(x_sorted, case.indices)


def test_permute_x_rows_mismatch(case):
    raises_invalid(lambda: a2a.permute(case.x[:10], case.indices, 5), "(10, 4)")


def test_permute_bad_index(case):
    bad = case.indices.copy()
    bad[7, 1] = 5
    message = raises_invalid(lambda: a2a.permute(case.x, bad, 5), "5")
    assert names_choice(message, 7, 1), message


def test_permute_x_dtype(case):
    raises_invalid(lambda: a2a.permute(np.zeros((50, 4), np.int64), case.indices, 5), "int64")


def test_unpermute_rows_mismatch(case):
    x_sorted, perm = a2a.permute(case.x, case.indices, 5)
    raises_invalid(lambda: a2a.unpermute(x_sorted[:-1], perm), str((perm.num_rows - 1, 4)))


def test_unpermute_gates(case):
    x_sorted, perm = a2a.permute(case.x, case.indices, 5)
    raises_invalid(lambda: a2a.unpermute(x_sorted, perm, gates=np.ones((50, 3), np.float32)), "(50, 3)")
    raises_invalid(lambda: a2a.unpermute(x_sorted, perm, gates=np.ones((50, 2), np.float64)), "float64")


# Non-contiguous inputs are rejected, naming the argument (never copied).


def test_non_contiguous_x(case):
    x = ref.moe_data("wide", (case.expected.num_tokens, 8), "float32")[:, ::2]
    assert not x.flags.c_contiguous
    raises_invalid(lambda: a2a.fast_encode(x, case.routing), "fast_encode: x (", "(50, 4)", "not C-contiguous")
    raises_invalid(lambda: a2a.permute(x, case.indices, 5), "permute: x (", "not C-contiguous")


def test_non_contiguous_torch_x(case, torch, torch_routing):
    wide = ref.moe_data("wide-t", (case.expected.num_tokens, 8), "float32")
    x = torch.from_numpy(wide).t().contiguous().t()[:, :4]  # column-major
    assert not x.is_contiguous()
    message = raises_invalid(lambda: a2a.fast_encode(x, torch_routing), "x (torch array", "not C-contiguous")
    assert ".contiguous()" in message, message
    x.requires_grad_(True)  # the autograd path checks the same way
    raises_invalid(lambda: a2a.fast_encode(x, torch_routing), "x (torch array", "not C-contiguous")


def test_non_contiguous_gates_and_dispatched(case):
    g = ref.moe_gates("wide", (case.expected.num_tokens, 4), "float32")[:, ::2]
    d = ref.moe_data("wide-d", (case.expected.num_experts, case.expected.capacity, 8), "float32")[:, :, 1::2]
    assert not g.flags.c_contiguous and not d.flags.c_contiguous
    raises_invalid(lambda: a2a.fast_decode(d, case.routing), "fast_decode: dispatched (", "not C-contiguous")
    raises_invalid(
        lambda: a2a.fast_decode(np.ascontiguousarray(d), case.routing, gates=g), "fast_decode: gates (", "not C-contiguous"
    )
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, gates=g), "fast_encode: gates (")


def test_non_contiguous_indices(case):
    wide = np.repeat(case.indices, 2, axis=1)[:, ::2]
    assert not wide.flags.c_contiguous
    raises_invalid(lambda: a2a.permute(case.x, wide, 5), "permute: indices (", "not C-contiguous")
    raises_invalid(lambda: a2a.route(wide, 5), "route: indices (", "not C-contiguous")


def test_non_contiguous_out_and_rows(case):
    x_sorted, perm = a2a.permute(case.x, case.indices, 5)
    strided = np.zeros((x_sorted.shape[0], 8), np.float32)[:, ::2]
    raises_invalid(lambda: a2a.unpermute(strided, perm), "unpermute: y_sorted (", "not C-contiguous")
    out = np.zeros((50, 8), np.float32)[:, ::2]
    raises_invalid(lambda: a2a.unpermute(x_sorted, perm, out=out), "unpermute: out (", "not C-contiguous")


def test_different_frameworks_are_rejected(case, torch):
    """A routing of NumPy indices with torch data (or the reverse)."""
    with pytest.raises(a2a.InvalidArgumentError):
        a2a.fast_encode(torch.from_numpy(case.x), case.routing)
    torch_routing = a2a.route(torch.from_numpy(case.indices), 5, capacity_setting=0.75)
    with pytest.raises(a2a.InvalidArgumentError):
        a2a.fast_encode(case.x, torch_routing)
    with pytest.raises(a2a.InvalidArgumentError):
        a2a.fast_encode(torch.from_numpy(case.x), torch_routing, gates=np.ones((50, 2), np.float32))


# ---------------------------------------------------------------------------
# out=: any C-contiguous array of the result's dtype and element count.


@pytest.mark.parametrize("shape", ["result", "flat", "other"])
def test_encode_into_out(case, shape):
    e, c = case.expected.num_experts, case.expected.capacity
    result_shape = (e, c, 4)
    out_shape = {"result": result_shape, "flat": (e * c * 4,), "other": (e * c, 4)}[shape]
    out = np.full(out_shape, np.nan, np.float32)  # padding must be overwritten too
    got = a2a.fast_encode(case.x, case.routing, out=out)
    assert got.shape == result_shape and np.shares_memory(got, out)
    ref.assert_bitwise_equal(got, ref.ref_encode(case.x, case.expected))


@pytest.mark.parametrize("shape", ["result", "flat"])
def test_decode_into_out(case, shape):
    d = ref.moe_data("out-d", case.d.shape, "float32")
    out = np.full((50, 4) if shape == "result" else (200,), np.nan, np.float32)
    got = a2a.fast_decode(d, case.routing, out=out)
    assert got.shape == (50, 4) and np.shares_memory(got, out)
    ref.assert_bitwise_equal(got, a2a.fast_decode(d, case.routing))


@pytest.mark.parametrize("shape", ["result", "flat"])
def test_permute_and_unpermute_into_out(case, shape):
    x_sorted, perm = a2a.permute(case.x, case.indices, 5)
    n = perm.num_rows
    out = np.full((n, 4) if shape == "result" else (n * 4,), np.nan, np.float32)
    got, _ = a2a.permute(case.x, case.indices, 5, out=out)
    assert got.shape == (n, 4) and np.shares_memory(got, out)
    ref.assert_bitwise_equal(got, x_sorted)
    out = np.full((50, 4) if shape == "result" else (200,), np.nan, np.float32)
    got = a2a.unpermute(x_sorted, perm, out=out)
    assert got.shape == (50, 4) and np.shares_memory(got, out)
    ref.assert_bitwise_equal(got, a2a.unpermute(x_sorted, perm))


def test_bad_out(case):
    e, c = case.expected.num_experts, case.expected.capacity
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, out=np.zeros((e, c, 4))), "out", "float64")
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, out=np.zeros((e, c, 5), np.float32)), "out")
    raises_invalid(
        lambda: a2a.fast_encode(case.x, case.routing, out=np.zeros((e, c, 8), np.float32)[:, :, ::2]), "out"
    )
    read_only = np.zeros((e, c, 4), np.float32)
    read_only.flags.writeable = False
    raises_invalid(lambda: a2a.fast_encode(case.x, case.routing, out=read_only), "read-only")


# ---------------------------------------------------------------------------
# A Routing does not depend on its input array after route() returns.


def test_routing_survives_changes_to_its_indices():
    indices = ref.moe_indices("alias", 40, 2, 4, 0.1, 0.5)
    expected = ref.ref_route(indices, 4, capacity=6)
    routing = a2a.route(indices, 4, capacity=6)
    x = ref.moe_data("alias", (40, 3), "float32")
    indices[:] = np.flip(indices, axis=0)  # still valid experts, other places
    ref.assert_routing_matches(routing, expected)
    ref.assert_bitwise_equal(a2a.fast_encode(x, routing), ref.ref_encode(x, expected))


def test_routing_survives_out_of_range_changes_to_its_indices():
    """Reusing the indices buffer (say, for the next batch's top-k) must not
    make a kernel read out of bounds. In a subprocess: it used to crash."""
    script = (
        "import numpy as np, a2a\n"
        "idx = np.array([[0, 1], [1, 0], [0, 0]])\n"
        "r = a2a.route(idx, 2, capacity=2)\n"
        "x = np.arange(6, dtype=np.float32).reshape(3, 2)\n"
        "want = a2a.fast_encode(x, r)\n"
        "idx[:] = 10**15\n"
        "assert (a2a.fast_encode(x, r) == want).all()\n"
        "fresh = a2a.route(np.array([[0, 1], [1, 0], [0, 0]]), 2, capacity=2)\n"
        "assert (a2a.fast_decode(want, r) == a2a.fast_decode(want, fresh)).all()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stderr[-2000:]}"


# The arrays a Routing hands out are copies: nothing done to them reaches the
# tables the kernels read.

EDIT_ROUTING_SCRIPT = """
import sys
import numpy as np, a2a
framework = sys.argv[1]
idx = np.array([[0, 1], [1, 0], [0, 0]])
x = np.arange(6, dtype=np.float32).reshape(3, 2)
if framework == "torch":
    import torch
    idx, x = torch.from_numpy(idx), torch.from_numpy(x)
TABLES = ("indices", "locations", "counts", "offsets")


def scribble(routing):
    for name in TABLES:
        table = getattr(routing, name)
        if framework == "numpy":
            try:
                table[:] = 1 << 40
            except ValueError as error:
                assert "read-only" in str(error), error
            else:
                raise SystemExit(f"{name} is writeable")
            table.flags.writeable = True  # a caller set on writing: it is a copy all the same
        table[:] = 1 << 40
        assert (getattr(routing, name) != 1 << 40).all(), f"{name} shows the edit"


r = a2a.route(idx, 2, capacity=2)
want = a2a.fast_encode(x, r)
scribble(r)
assert (a2a.fast_encode(x, r) == want).all()
assert (a2a.fast_decode(want, r) == a2a.fast_decode(want, a2a.route(idx, 2, capacity=2))).all()
y, perm = a2a.permute(x, idx, 2)
scribble(perm)
assert (a2a.unpermute(y, perm) == a2a.unpermute(y, a2a.permute(x, idx, 2)[1])).all()

# Copies and pickles read their own tables, not the original's (freed here).
import copy, gc, pickle
r = a2a.route(idx, 2, capacity=2)
copies = [copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))]
del r
gc.collect()
for other in copies:
    scribble(other)
    assert (a2a.fast_encode(x, other) == want).all()
"""


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_editing_routing_arrays_cannot_reach_the_kernels(framework):
    """Routing.indices[:] = 1 << 40 and the like, then the kernels, also on
    copies of a routing whose original is gone: in a subprocess, as this used
    to crash with a segmentation fault."""
    if framework == "torch":
        pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", EDIT_ROUTING_SCRIPT, framework], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stderr[-2000:]}"


def test_routing_attributes_are_read_only(case):
    for name in ("indices", "locations", "counts", "offsets", "row_map", "capacity", "num_rows", "num_experts",
                 "num_tokens", "top_k", "num_dropped"):
        with pytest.raises(AttributeError):
            setattr(case.routing, name, 10**9)
    assert not case.routing.indices.flags.writeable and not case.routing.counts.flags.writeable


def test_a_routing_is_not_made_by_hand():
    with pytest.raises(TypeError, match="a2a.route or a2a.permute"):
        a2a.Routing()


def test_torch_routing_arrays_are_new_copies(torch, torch_routing):
    first, second = torch_routing.counts, torch_routing.counts
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()


# Arguments that are no array at all: TypeError naming the argument and what is accepted.

ACCEPTED = "expected a NumPy array, a torch tensor, a CuPy array, or an object exporting DLPack"


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, "x", 3.0], ids=["list", "None", "str", "float"])
def test_non_arrays_are_type_errors(case, bad):
    routing, x = case.routing, case.x
    x_sorted, perm = a2a.permute(x, case.indices, 5)
    calls = {
        "fast_encode: x ": lambda: a2a.fast_encode(bad, routing),
        "fast_encode: gates ": lambda: a2a.fast_encode(x, routing, gates=bad),
        "fast_decode: dispatched ": lambda: a2a.fast_decode(bad, routing),
        "fast_decode: gates ": lambda: a2a.fast_decode(case.d, routing, gates=bad),
        "permute: x ": lambda: a2a.permute(bad, case.indices, 5),
        "permute: indices ": lambda: a2a.permute(x, bad, 5),
        "unpermute: y_sorted ": lambda: a2a.unpermute(bad, perm),
        "unpermute: gates ": lambda: a2a.unpermute(x_sorted, perm, gates=bad),
        "route: indices ": lambda: a2a.route(bad, 5),
        "route: scores ": lambda: a2a.route(case.indices, 5, scores=bad, batch_prioritized=True),
    }
    for prefix, call in calls.items():
        if bad is None and prefix.endswith("gates "):
            continue  # no gates
        if bad is None and prefix == "route: scores ":
            continue  # reported as missing scores
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert message.startswith(prefix + "of type ") and ACCEPTED in message, message
    for value in ([[1.0]], "out"):
        with pytest.raises(TypeError, match=r"^fast_encode: out of type"):
            a2a.fast_encode(x, routing, out=value)


# ---------------------------------------------------------------------------
# Thread counts: A2A_NUM_THREADS is read once per process, so each count runs
# in a subprocess; results must not depend on it.

THREADS_SCRIPT = """
import sys
import numpy as np
import a2a
sys.path.insert(0, sys.argv[2])
import reference as ref
indices = ref.moe_indices("threads", 60000, 2, 24, 0.05, 0.05)
scores = np.random.default_rng(0).integers(0, 50, size=60000).astype(np.float32)
routing = a2a.route(indices, 24, capacity_setting=0.9, scores=scores, batch_prioritized=True)
x = ref.moe_data("threads", (60000, 8), "float16")
g = ref.moe_gates("threads", (60000, 2), "float32")
d = a2a.fast_encode(x, routing, gates=g)
y = a2a.fast_decode(d, routing, gates=g)
x_sorted, perm = a2a.permute(x, indices, 24)
np.savez(sys.argv[1], locations=routing.locations, capacity=routing.capacity, d=d, y=y, x_sorted=x_sorted,
         perm_locations=perm.locations)
"""


@pytest.fixture(scope="module")
def threads_results(tmp_path_factory):
    results = {}
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for threads in (1, 3, 8):
        path = tmp_path_factory.mktemp("threads") / f"t{threads}.npz"
        env = {**os.environ, "A2A_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-c", THREADS_SCRIPT, str(path), tests_dir],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results[threads] = dict(np.load(path))
    return results


def test_thread_count_does_not_change_results(threads_results):
    indices = ref.moe_indices("threads", 60000, 2, 24, 0.05, 0.05)
    scores = np.random.default_rng(0).integers(0, 50, size=60000).astype(np.float32)
    expected = ref.ref_route(indices, 24, capacity_setting=0.9, order=ref.ref_slot_order(scores))
    x = ref.moe_data("threads", (60000, 8), "float16")
    g = ref.moe_gates("threads", (60000, 2), "float32")
    want_d = ref.ref_encode(x, expected, g)
    want_perm = ref.ref_route(indices, 24, dropless=True)
    for threads, got in threads_results.items():
        assert int(got["capacity"]) == expected.capacity, threads
        np.testing.assert_array_equal(got["locations"], expected.locations, err_msg=f"{threads} threads")
        np.testing.assert_array_equal(
            got["perm_locations"], want_perm.locations, err_msg=f"{threads} threads"
        )
        ref.assert_bitwise_equal(got["d"], want_d, f"encode, {threads} threads")
        ref.assert_bitwise_equal(
            got["x_sorted"], ref.ref_permute(x, want_perm), f"permute, {threads} threads"
        )
        # Each token's sum is formed by one thread: the same bits for any count.
        ref.assert_bitwise_equal(got["y"], threads_results[1]["y"], f"decode, {threads} vs 1 threads")


def test_read_only_inputs_are_fine(case):
    x = case.x.copy()
    x.flags.writeable = False
    ref.assert_bitwise_equal(a2a.fast_encode(x, case.routing), ref.ref_encode(case.x, case.expected))


def test_non_native_byte_order_rejected(case):
    raises_invalid(lambda: a2a.fast_encode(case.x.astype(">f4"), case.routing), "byte order")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kernels_work_in_a_forked_child():
    """The CPU thread pool does not survive fork (e.g. DataLoader workers): a
    child that calls the kernels after the parent did must get a new pool,
    not wait forever for workers it does not have."""
    script = """
import os, numpy as np, a2a
indices = np.random.default_rng(0).integers(0, 8, (100000, 2))
x = np.ones((100000, 64), np.float32)
a2a.fast_encode(x, a2a.route(indices, 8))           # starts the parent's workers
pid = os.fork()
if pid == 0:
    out = a2a.fast_encode(x, a2a.route(indices, 8))
    os._exit(0 if out.sum() == 2 * 100000 * 64 - 64 * a2a.route(indices, 8).num_dropped else 3)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    env = dict(os.environ, A2A_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", script], check=False, env=env, timeout=60, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
