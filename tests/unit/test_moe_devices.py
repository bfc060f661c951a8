"""The MoE kernels on torch tensors of every device this machine has (CPU,
and CUDA when torch sees a GPU and a2a was built with CUDA), against the
NumPy reference: the CUDA backend's tiled location scan, its vector loads
with misaligned rows, the current stream, and autograd on the device."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref

import a2a

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch

DEVICES = ["cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("torch sees no CUDA device")
        if not a2a.config().get("cuda"):
            pytest.skip("a2a was built without CUDA")
        # With its index: a tensor's device is cuda:0, and torch.device("cuda") compares unequal to it.
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)


def on(device, bits, dtype):
    return ref.to_framework(bits, dtype, "torch").to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# name: (T, k, E, route kwargs, fraction unrouted, skew)
ROUTES = {
    "small": (37, 2, 5, {"capacity_setting": 0.75}, 0.1, 0.7),
    "one-expert": (9, 3, 1, {}, 0.3, 0.0),
    "no-tokens": (0, 2, 4, {}, 0.0, 0.0),
    "tiles": (70000, 2, 40, {"capacity_setting": 1.0}, 0.05, 0.03),  # many scan tiles
    "many-experts": (3000, 4, 700, {"capacity_setting": 0}, 0.02, 0.0),
    "top1-fixed": (5000, 1, 8, {"capacity": 300}, 0.0, 0.2),
}


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("name", list(ROUTES))
def test_route(device, name, index_dtype):
    num_tokens, top_k, num_experts, kwargs, unrouted, skew = ROUTES[name]
    indices = ref.moe_indices(name, num_tokens, top_k, num_experts, unrouted, skew).astype(index_dtype)
    routing = a2a.route(on(device, indices, index_dtype), num_experts, **kwargs)
    for attr in ("locations", "counts", "offsets", "row_map"):
        assert getattr(routing, attr).device == device, attr
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, **kwargs), name)


def test_route_batch_prioritized(device):
    indices = ref.moe_indices("bpr-dev", 20000, 2, 16, 0.05, 0.2)
    scores = np.random.default_rng(1).integers(0, 30, size=(20000, 3)).astype(np.float32)  # many ties
    routing = a2a.route(
        on(device, indices, "int64"),
        16,
        capacity_setting=0.5,
        scores=on(device, scores, "float32"),
        batch_prioritized=True,
    )
    expected = ref.ref_route(indices, 16, capacity_setting=0.5, order=ref.ref_slot_order(scores))
    ref.assert_routing_matches(routing, expected)


def test_route_names_the_first_bad_choice(device):
    indices = ref.moe_indices("bad-dev", 50000, 2, 8)
    indices[40000, 0] = 9
    indices[31234, 1] = 8
    with pytest.raises(a2a.InvalidArgumentError, match=r"indices\[31234, 1\] = 8"):
        a2a.route(on(device, indices, "int64"), 8)
    # The device is fine afterwards.
    ok = ref.moe_indices("ok-dev", 100, 2, 8)
    ref.assert_routing_matches(a2a.route(on(device, ok, "int64"), 8), ref.ref_route(ok, 8))


@pytest.mark.parametrize("model_dim", [1, 3, 8, 13, 1000])
@pytest.mark.parametrize("gates", ["none", "float32", "same"])
@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_encode_decode(device, dtype, gates, model_dim):
    num_tokens, top_k, num_experts, kwargs, unrouted, skew = ROUTES["small"]
    indices = ref.moe_indices("small", num_tokens, top_k, num_experts, unrouted, skew)
    expected = ref.ref_route(indices, num_experts, **kwargs)
    routing = a2a.route(on(device, indices, "int64"), num_experts, **kwargs)
    tag = f"dev-{dtype}-{gates}-{model_dim}"
    gate_dtype = None if gates == "none" else ("float32" if gates == "float32" else dtype)
    x = ref.moe_data(tag, (num_tokens, model_dim), dtype)
    g = None if gate_dtype is None else ref.moe_gates(tag, indices.shape, gate_dtype)
    g_dev = None if g is None else on(device, g, gate_dtype)

    out = a2a.fast_encode(on(device, x, dtype), routing, gates=g_dev)
    assert out.device == device and tuple(out.shape) == (num_experts, expected.capacity, model_dim)
    ref.assert_bitwise_equal(
        out, ref.ref_encode(x, expected, g, dtype=dtype, gate_dtype=gate_dtype), "encode"
    )

    d = ref.moe_data(tag, (num_experts, expected.capacity, model_dim), dtype, "dyadic")
    gd = None if gate_dtype is None else ref.moe_gates(tag, indices.shape, gate_dtype, "dyadic")
    y = a2a.fast_decode(
        on(device, d, dtype), routing, gates=None if gd is None else on(device, gd, gate_dtype)
    )
    assert y.device == device
    want = ref.ref_decode(d, expected, gd, dtype=dtype, gate_dtype=gate_dtype)
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), ref.to_float(want, dtype))


@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_misaligned_rows(device, dtype):
    """Arrays that start off a 16-byte boundary (a storage offset of one
    element) and rows of odd width: the vector paths must fall back."""
    num_tokens, top_k, num_experts, kwargs, unrouted, skew = ROUTES["small"]
    indices = ref.moe_indices("small", num_tokens, top_k, num_experts, unrouted, skew)
    expected = ref.ref_route(indices, num_experts, **kwargs)
    routing = a2a.route(on(device, indices, "int64"), num_experts, **kwargs)
    model_dim = 37
    x = ref.moe_data(f"mis-{dtype}", (num_tokens, model_dim), dtype)
    flat = torch.zeros(x.size + 1, dtype=getattr(torch, dtype), device=device)
    x_dev = flat[1:].view(num_tokens, model_dim)
    x_dev.copy_(on(device, x, dtype))
    assert x_dev.is_contiguous() and x_dev.data_ptr() % 16 != 0
    out = torch.full(
        (num_experts * expected.capacity * model_dim + 1,), float("nan"), dtype=x_dev.dtype, device=device
    )
    got = a2a.fast_encode(x_dev, routing, out=out[1:].view(num_experts, expected.capacity, model_dim))
    ref.assert_bitwise_equal(got, ref.ref_encode(x, expected, dtype=dtype), "encode, misaligned")
    y = a2a.fast_decode(got, routing)
    ref.assert_bitwise_equal(y, a2a.fast_decode(got.contiguous().clone(), routing), "decode, misaligned")


@pytest.mark.parametrize("dtype", ref.MOE_DTYPES)
def test_permute_unpermute(device, dtype):
    num_tokens, top_k, num_experts, _, unrouted, skew = ROUTES["many-experts"]
    indices = ref.moe_indices("many-experts", num_tokens, top_k, num_experts, unrouted, skew)
    expected = ref.ref_route(indices, num_experts, dropless=True)
    x = ref.moe_data(f"perm-dev-{dtype}", (num_tokens, 24), dtype, "dyadic")
    x_sorted, perm = a2a.permute(on(device, x, dtype), on(device, indices, "int64"), num_experts)
    assert x_sorted.device == device
    ref.assert_routing_matches(perm, expected)
    ref.assert_bitwise_equal(x_sorted, ref.ref_permute(x, expected, dtype=dtype), "permute")
    g = ref.moe_gates(f"perm-dev-{dtype}", indices.shape, "float32", "dyadic")
    y = a2a.unpermute(x_sorted, perm, gates=on(device, g, "float32"))
    want = ref.ref_unpermute(
        ref.ref_permute(x, expected, dtype=dtype), expected, g, dtype=dtype, gate_dtype="float32"
    )
    np.testing.assert_array_equal(ref.to_float(ref.as_numpy(y), dtype), ref.to_float(want, dtype))


def test_runs_on_the_current_stream(device):
    """Kernels go to torch's current stream: results are ready in stream order."""
    if device.type != "cuda":
        pytest.skip("streams are CUDA's")
    num_tokens, num_experts = 200000, 64
    indices = ref.moe_indices("stream", num_tokens, 2, num_experts, 0.0, 0.0)
    x = ref.moe_data("stream", (num_tokens, 64), "float32")
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        idx = on(device, indices, "int64")
        x_dev = on(device, x, "float32")
        routing = a2a.route(idx, num_experts, capacity_setting=0)
        out = a2a.fast_encode(x_dev, routing)
        y = a2a.fast_decode(out * 2.0, routing)
    stream.synchronize()
    np.testing.assert_array_equal(ref.as_numpy(y), 4.0 * x)  # two kept choices, each doubled


@pytest.mark.parametrize("op", ["encode", "decode", "unpermute"])
def test_gradcheck(device, op):
    num_tokens, top_k, num_experts = 10, 2, 3
    indices = ref.moe_indices("grad-dev", num_tokens, top_k, num_experts, 0.15, 0.8)
    idx = on(device, indices, "int64")
    routing = a2a.route(idx, num_experts, capacity=3)
    _, perm = a2a.permute(torch.zeros(num_tokens, 1, device=device), idx, num_experts)
    generator = torch.Generator().manual_seed(0)
    gates = (torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64) + 0.1).to(device)
    gates.requires_grad_()
    if op == "encode":
        data = torch.randn(num_tokens, 4, generator=generator, dtype=torch.float64)
        fn = lambda d, g: a2a_torch.fast_encode(d, routing, g)
    elif op == "decode":
        data = torch.randn(num_experts, 3, 4, generator=generator, dtype=torch.float64)
        fn = lambda d, g: a2a_torch.fast_decode(d, routing, g)
    else:
        data = torch.randn(perm.num_rows, 4, generator=generator, dtype=torch.float64)
        fn = lambda d, g: a2a_torch.unpermute(d, perm, g)
    data = data.to(device).requires_grad_()
    assert torch.autograd.gradcheck(fn, (data, gates), eps=1e-6, atol=1e-7, rtol=1e-5)
