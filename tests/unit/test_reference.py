"""The NumPy reference that the MPI suite trusts, checked against itself.

Three formulations must agree for simulated worlds: the block-wise inputs and
expectations (what each MPI rank computes locally), np.split/concatenate over
every rank's input, and an axis-moving formulation.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def flex_problems(draw):
    world = draw(st.integers(1, 5))
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    split = draw(st.integers(0, ndim - 1))
    concat = draw(st.integers(0, ndim - 1))
    shape[split] *= world
    dtype = draw(st.sampled_from(ref.ALL_DTYPES))
    return world, tuple(shape), split, concat, dtype


@SETTINGS
@given(flex_problems())
def test_block_wise_flex_matches_the_whole_world_reference(problem):
    world, shape, split, concat, dtype = problem
    inputs = [ref.flex_input("t", r, world, shape, split, dtype) for r in range(world)]
    for x in inputs:
        assert x.shape == shape and x.dtype == ref.storage_dtype(dtype)
    by_split = ref.ref_all_to_all_flex(inputs, split, concat)
    by_transpose = ref.ref_flex_by_transpose(inputs, split, concat)
    for r in range(world):
        expected = ref.flex_expected("t", r, world, shape, split, concat, dtype)
        out_shape = list(shape)
        out_shape[split] //= world
        out_shape[concat] *= world
        assert expected.shape == tuple(out_shape)
        ref.assert_bitwise_equal(by_split[r], expected, f"np.split reference, rank {r}")
        ref.assert_bitwise_equal(by_transpose[r], expected, f"transpose reference, rank {r}")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("pattern", ref.V_PATTERNS)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)], ids=str)
def test_block_wise_v_matches_the_whole_world_reference(world, pattern, row_shape):
    counts = ref.v_counts(pattern, world)
    assert counts.shape == (world, world) and (counts >= 0).all()
    inputs = [ref.v_input("v", r, counts, row_shape, "float32") for r in range(world)]
    for r, x in enumerate(inputs):
        assert x.shape == (counts[r].sum(), *row_shape)
    outputs = ref.ref_all_to_all_v(inputs, counts)
    for r in range(world):
        recv, recv_counts = ref.v_expected("v", r, counts, row_shape, "float32")
        ref.assert_bitwise_equal(outputs[r][0], recv)
        assert recv_counts.tolist() == outputs[r][1].tolist() == counts[:, r].tolist()


def test_v_patterns_cover_the_edge_cases():
    c = ref.v_counts("empty_odd_ranks", 4)
    assert c[1].sum() == 0 and c[0].sum() > 0
    assert ref.v_counts("all_zero", 3).sum() == 0
    assert (ref.v_counts("varied", 4) == 0).any()
    c = ref.v_counts("zero_to_next", 3)
    assert c[0, 1] == 0 and c[2, 0] == 0


def test_all_to_all_reference_is_mpi_alltoall():
    # Rank r sends the value 10 * r + i to rank i.
    world = 3
    inputs = [np.array([10 * r + i for i in range(world)]) for r in range(world)]
    outputs = ref.ref_all_to_all(inputs)
    for r in range(world):
        assert outputs[r].tolist() == [10 * j + r for j in range(world)]


def test_flex_reference_is_jax_all_to_all():
    # lax.all_to_all(x, axis_name, split_axis=0, concat_axis=1) on 2 devices.
    x0 = np.array([[0, 1], [2, 3]])
    x1 = np.array([[4, 5], [6, 7]])
    y0, y1 = ref.ref_all_to_all_flex([x0, x1], 0, 1)
    assert y0.tolist() == [[0, 1, 4, 5]]
    assert y1.tolist() == [[2, 3, 6, 7]]


def test_blocks_are_deterministic_and_distinct():
    a = ref.block("x", 0, 1, (5, 3), "float32")
    assert ref.raw_bytes(a).tolist() == ref.raw_bytes(ref.block("x", 0, 1, (5, 3), "float32")).tolist()
    assert not np.array_equal(ref.raw_bytes(a), ref.raw_bytes(ref.block("x", 1, 0, (5, 3), "float32")))
    assert not np.array_equal(ref.raw_bytes(a), ref.raw_bytes(ref.block("y", 0, 1, (5, 3), "float32")))
    assert a.flags.writeable and a.flags.c_contiguous


def test_assert_bitwise_equal_sees_nan_payloads_and_signed_zeros():
    a = np.array([0.0, np.nan], np.float32)
    b = a.copy()
    b[0] = -0.0
    with pytest.raises(AssertionError, match="differ"):
        ref.assert_bitwise_equal(a, b)
    c = a.copy()
    c.view(np.uint32)[1] ^= 1  # another NaN payload
    with pytest.raises(AssertionError):
        ref.assert_bitwise_equal(a, c)
    with pytest.raises(AssertionError, match="shape"):
        ref.assert_bitwise_equal(a, a.reshape(1, 2))


def test_torch_conversion_keeps_bits():
    torch = pytest.importorskip("torch")
    bits = ref.block("bf", 0, 0, (3, 4), "bfloat16")
    t = ref.to_framework(bits, "bfloat16", "torch")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (3, 4)
    assert ref.raw_bytes(t).tolist() == bits.view(np.uint8).reshape(-1).tolist()
    ref.assert_bitwise_equal(t, bits)


# ---------------------------------------------------------------------------
# The MoE reference (ref_route and the sparse kernels) against hand-worked
# cases and GShard's dense formulation.


def test_moe_route_reference_by_hand():
    """Tutel's order: all first choices, then all second choices."""
    r = ref.ref_route(np.array([[0, 1], [0, 0], [1, 0]]), 2, capacity=2)
    assert r.locations.tolist() == [[0, 1], [1, 2], [0, 3]]
    assert r.counts.tolist() == [2, 2] and r.offsets.tolist() == [0, 2, 4]
    assert r.row_map.tolist() == [[0, 3], [1, -1], [2, -1]]
    assert (r.capacity, r.num_dropped, r.num_rows) == (2, 2, 4)
    # Prioritized: token 2 first, then 1, then 0.
    r = ref.ref_route(np.array([[0, -1], [0, 1], [0, 1]]), 2, capacity=2, order=[2, 1, 0])
    assert r.locations.tolist() == [[2, -1], [1, 1], [0, 0]]
    assert r.row_map.tolist() == [[-1, -1], [1, 3], [0, 2]]
    # Dropless: experts packed, nothing dropped.
    r = ref.ref_route(np.array([[2, 0], [0, 2], [1, -1], [2, 2]]), 3, dropless=True)
    assert r.capacity is None and r.num_dropped == 0
    assert r.offsets.tolist() == [0, 2, 3, 7] and r.row_map.tolist() == [[3, 1], [0, 5], [2, -1], [4, 6]]


@pytest.mark.parametrize(
    "setting, demand, expected",
    [
        (None, [7, 1], 4),
        (1.0, [7, 1], 4),
        (0.5, [7, 1], 2),
        (0, [7, 1], 7),
        (-0.5, [7, 1], 2),
        (-4, [7, 1], 7),
    ],
)
def test_moe_capacity_rule(setting, demand, expected):
    # T = 4, k = 2, E = 2: ceil(k * x * T / E) = ceil(4x)
    assert ref.ref_capacity(np.array(demand), 4, 2, 2, capacity_setting=setting) == expected
    assert ref.ref_capacity(np.array(demand), 4, 2, 2, capacity=5, capacity_setting=setting) == 5


def test_moe_capacity_uses_float64_as_written():
    assert ref.ref_capacity(np.array([0]), 60000, 2, 24, capacity_setting=0.9) == 4500


@SETTINGS
@given(st.integers(0, 40), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_moe_sparse_reference_matches_gshard_einsum(num_tokens, top_k, num_experts, capacity, seed):
    indices = ref.moe_indices(f"r{seed}", num_tokens, top_k, num_experts, unrouted=0.2, skew=0.5)
    routing = ref.ref_route(indices, num_experts, capacity=capacity)
    x = ref.moe_data(f"r{seed}", (num_tokens, 3), "float64")
    g = ref.moe_gates(f"r{seed}", indices.shape, "float64")
    mask, weights = ref.ref_dense_routing(routing, g)
    np.testing.assert_array_equal(ref.ref_encode(x, routing, g), ref.ref_gshard_dispatch(x, weights))
    np.testing.assert_array_equal(ref.ref_encode(x, routing), ref.ref_gshard_dispatch(x, mask))
    out = ref.moe_data(f"o{seed}", (num_experts, capacity, 3), "float64")
    dense = ref.ref_gshard_combine(weights, out)
    np.testing.assert_allclose(ref.ref_decode(out, routing, g), dense, rtol=1e-13, atol=1e-13)
    # Mass conservation.
    assert routing.counts.sum() + routing.num_dropped == (indices >= 0).sum() == routing.demand.sum()
    assert mask.sum() == routing.counts.sum()


def test_bfloat16_conversion_matches_torch():
    torch = pytest.importorskip("torch")
    values = np.concatenate(
        [
            np.random.default_rng(0).standard_normal(5000) * 10.0 ** np.arange(-20, 30, 0.01)[:5000],
            [0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40],
        ]
    ).astype(np.float32)
    bits = ref.float32_to_bfloat16_bits(values)
    expected = torch.from_numpy(values).bfloat16().view(torch.int16).numpy()
    np.testing.assert_array_equal(bits, expected)
    back = ref.bfloat16_bits_to_float32(bits)
    np.testing.assert_array_equal(back, torch.from_numpy(expected).view(torch.bfloat16).float().numpy())
    nan_bits = ref.float32_to_bfloat16_bits(np.array([np.nan], np.float32))
    assert np.isnan(ref.bfloat16_bits_to_float32(nan_bits))[0]


def test_moe_dyadic_data_are_exact_in_every_dtype():
    for dtype in ref.MOE_DTYPES:
        x = ref.to_float(ref.moe_data("d", (50, 7), dtype, "dyadic"), dtype)
        assert (x != 0).all() and (np.abs(x) <= 4).all() and (x * 2 == np.round(x * 2)).all()
        g = ref.to_float(ref.moe_gates("d", (50, 2), dtype, "dyadic"), dtype)
        assert ((g * 8) == np.round(g * 8)).all() and (g > 0).all() and (g <= 1).all()
