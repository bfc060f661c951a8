"""The CUDA backend of the MoE kernels against the CPU backend, with torch
CUDA tensors.

route must agree exactly (locations, counts, offsets, capacity, drops).
fast_encode and permute form one product per element, converted the same
way on both sides (moe/elementwise.hpp over core/half.hpp), so they are
compared bitwise in every dtype. Sums (fast_decode, unpermute) and gradients are compared within
float32 accumulation tolerance (float64 for float64). Skipped without a GPU
or a CUDA build of a2a (conftest.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_data import DEVICE, DTYPES, STORE_EPS, generator, make_data, make_gates, make_indices, on_device

import a2a
import a2a.torch

MODEL_DIMS = (1, 7, 8, 1000, 4096)
GATES = ("none", "float32", "same")
# (rtol, atol) of one sum of a few products, rounded once to the dtype.
SUM_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-12),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def route_both(indices, num_experts, **kwargs):
    """(cpu routing, gpu routing), checked equal."""
    cpu = a2a.route(indices, num_experts, **kwargs)
    gpu_kwargs = {name: on_device(v) if torch.is_tensor(v) else v for name, v in kwargs.items()}
    gpu = a2a.route(indices.to(DEVICE), num_experts, **gpu_kwargs)
    assert_same_routing(gpu, cpu)
    return cpu, gpu


def assert_equal_tensors(got, want, what):
    assert got.device.type == DEVICE, f"{what} is on {got.device}"
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    )
    if not torch.equal(got, want):
        first = tuple((got != want).nonzero()[0].tolist())
        raise AssertionError(
            f"{what} differs first at {first}: gpu {got[first].item()} cpu {want[first].item()}"
        )


def assert_same_routing(gpu, cpu):
    for name in ("locations", "counts", "offsets"):
        assert_equal_tensors(getattr(gpu, name), getattr(cpu, name), name)
    assert gpu.per_expert == cpu.per_expert
    capacities = [c.tolist() if gpu.per_expert else c for c in (gpu.capacity, cpu.capacity)]
    assert (capacities[0], gpu.num_rows, gpu.num_dropped) == (capacities[1], cpu.num_rows, cpu.num_dropped)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(got, want, what):
    assert got.device.type == DEVICE, f"{what} is on {got.device}"
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    )
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        first = tuple((g != w).nonzero()[0].tolist())
        raise AssertionError(
            f"{what} differs first at {first}: gpu {got.cpu()[first].item()!r} cpu {want[first].item()!r} "
            f"({int((g != w).sum())} elements differ)"
        )


def assert_close_sum(got, want, what):
    assert got.device.type == DEVICE, f"{what} is on {got.device}"
    rtol, atol = SUM_TOLERANCE[want.dtype]
    torch.testing.assert_close(
        got.detach().cpu(), want.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def assert_close_dot(got, want, magnitude, terms, what):
    """Gate gradients (dot products of `terms` elements): each side is within
    the worst-case accumulation error terms * eps * sum_i |a_i b_i|
    (`magnitude`, per choice) plus the rounding of the result to its dtype."""
    assert got.device.type == DEVICE and got.dtype == want.dtype, (
        f"{what}: {got.device} {got.dtype} vs {want.dtype}"
    )
    acc_eps = 2.0**-53 if want.dtype == torch.float64 else 2.0**-24
    store_eps = STORE_EPS[want.dtype]
    got, want = got.detach().cpu().double(), want.detach().double()
    slack = 2 * terms * acc_eps * magnitude + 2 * store_eps * want.abs() + 1e-30
    excess = (got - want).abs() - slack
    assert bool((excess <= 0).all()), f"{what}: largest excess {excess.max().item()} over the bound"


# --- route ---------------------------------------------------------------------------------

# name: (T, k, E, index dtype, route kwargs, unrouted, skew)
ROUTE_CASES = {
    "top2-not-tile-multiple": (1000, 2, 8, torch.int64, {}, 0.1, 0.0),
    "one-token-one-expert": (1, 1, 1, torch.int32, {}, 0.0, 0.0),
    "one-expert": (777, 2, 1, torch.int64, {"capacity_setting": 0}, 0.2, 0.0),
    "e300-no-drop": (513, 3, 300, torch.int64, {"capacity_setting": 0}, 0.1, 0.0),
    "e300-capacity-5": (4097, 4, 300, torch.int32, {"capacity": 5}, 0.05, 2.0),
    "skewed-negative-setting": (3000, 2, 16, torch.int64, {"capacity_setting": -0.5}, 0.1, 3.0),
    "factor-drops": (2048, 2, 16, torch.int32, {"capacity_setting": 0.7}, 0.0, 1.0),
    "all-unrouted": (300, 2, 4, torch.int64, {"capacity": 3}, 1.0, 0.0),
    "no-tokens": (0, 2, 4, torch.int64, {"capacity": 2}, 0.0, 0.0),
    "top10": (600, 10, 16, torch.int64, {}, 0.1, 0.0),
}


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_route_matches_cpu(name):
    T, k, E, index_dtype, kwargs, unrouted, skew = ROUTE_CASES[name]
    indices = make_indices(T, k, E, dtype=index_dtype, unrouted=unrouted, skew=skew)
    route_both(indices, E, **kwargs)


@pytest.mark.parametrize("score_shape", ["tokens", "tokens-by-4"])
def test_route_batch_prioritized_matches_cpu(score_shape):
    T, k, E = 5000, 2, 32
    indices = make_indices(T, k, E, skew=1.0)
    shape = (T,) if score_shape == "tokens" else (T, 4)
    scores = torch.round(torch.rand(*shape, generator=generator(T, 3)) * 10) / 10  # many ties
    cpu, _ = route_both(indices, E, scores=scores, batch_prioritized=True, capacity_setting=0.8)
    plain = a2a.route(indices, E, capacity_setting=0.8)
    assert not torch.equal(plain.locations, cpu.locations), "the scores did not change the slot order"


def test_route_big_matches_cpu():
    # 140000 choices: hundreds of tiles; with scores, a token order over all of them.
    indices = make_indices(70000, 2, 64, unrouted=0.05, skew=1.0)
    route_both(indices, 64, capacity_setting=1.0)
    scores = torch.rand(70000, generator=generator(70000, 5))
    route_both(indices, 64, scores=scores, batch_prioritized=True, capacity_setting=0.0)


def test_route_many_tiles_matches_cpu():
    # 2.2M choices: more than 4096 tiles of 512, so tiles grow, and the scan
    # over tiles takes several chunks.
    indices = make_indices(1_100_000, 2, 8, dtype=torch.int32, unrouted=0.01)
    route_both(indices, 8, capacity_setting=0.9)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("prioritized", [False, True])
def test_index_out_of_range_raises_like_cpu(index_dtype, prioritized):
    T, k, E = 1000, 2, 8
    indices = make_indices(T, k, E, dtype=index_dtype)
    indices[700, 1] = E
    indices[300, 1] = E + 3  # the first offender in (token, choice) order
    indices[900, 0] = 1000
    kwargs = (
        {"scores": torch.rand(T, generator=generator(T, 9)), "batch_prioritized": True} if prioritized else {}
    )
    with pytest.raises(a2a.InvalidArgumentError) as cpu_error:
        a2a.route(indices, E, **kwargs)
    gpu_kwargs = {name: on_device(v) if torch.is_tensor(v) else v for name, v in kwargs.items()}
    with pytest.raises(a2a.InvalidArgumentError) as gpu_error:
        a2a.route(indices.to(DEVICE), E, **gpu_kwargs)
    assert str(gpu_error.value) == str(cpu_error.value)
    assert f"indices[300, 1] = {E + 3} is out of range for num_experts {E}" in str(gpu_error.value)
    # The device and stream are still usable afterwards.
    indices[indices >= E] = -1
    route_both(indices, E)


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_route_without_waiting_matches_cpu(name):
    # route(wait=False) at the capacity the waiting route chose: the same tables, counts made on the device.
    T, k, E, index_dtype, kwargs, unrouted, skew = ROUTE_CASES[name]
    indices = make_indices(T, k, E, dtype=index_dtype, unrouted=unrouted, skew=skew)
    cpu = a2a.route(indices, E, **kwargs)
    gpu = a2a.route(indices.to(DEVICE), E, capacity=cpu.capacity, wait=False)
    assert_same_routing(gpu, cpu)


@pytest.mark.parametrize("prioritized", [False, True])
def test_route_without_waiting_defers_a_bad_index_like_cpu(prioritized):
    T, k, E = 1000, 2, 8
    indices = make_indices(T, k, E)
    indices[300, 1] = E + 3
    kwargs = {"scores": torch.rand(T, generator=generator(T, 9)), "batch_prioritized": True} if prioritized else {}
    gpu_kwargs = {name: on_device(v) if torch.is_tensor(v) else v for name, v in kwargs.items()}
    cpu = a2a.route(indices, E, capacity=200, wait=False, **kwargs)
    gpu = a2a.route(indices.to(DEVICE), E, capacity=200, wait=False, **gpu_kwargs)
    assert_equal_tensors(gpu.locations, cpu.locations, "locations with a bad index")  # -1 there
    with pytest.raises(a2a.InvalidArgumentError) as cpu_error:
        _ = cpu.num_dropped
    with pytest.raises(a2a.InvalidArgumentError) as gpu_error:
        _ = gpu.num_dropped
    assert str(gpu_error.value) == str(cpu_error.value)


def test_route_without_waiting_is_captured_in_a_cuda_graph():
    # route(wait=False) + encode + decode in one graph, replayed on new indices and tokens: what eager gives.
    T, k, E, M, C = 3000, 2, 16, 64, 300
    static_indices = make_indices(T, k, E, skew=1.0).to(DEVICE)
    static_x = make_data((T, M), torch.float32, 4).to(DEVICE)
    a2a.route(static_indices, E, capacity=C, wait=False)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routing = a2a.route(static_indices, E, capacity=C, wait=False)
        y = a2a.fast_decode(a2a.fast_encode(static_x, routing), routing)
    for seed in (1, 2):
        indices = make_indices(T, k, E, skew=float(seed), seed=seed)
        x = make_data((T, M), torch.float32, seed)
        static_indices.copy_(indices)
        static_x.copy_(x)
        graph.replay()
        # the tables against the host's route (num_dropped read after the replay, from the graph's
        # workspace); the tokens against the same calls run eagerly on the device
        assert_same_routing(routing, a2a.route(indices, E, capacity=C, wait=False))
        eager = a2a.route(indices.to(DEVICE), E, capacity=C, wait=False)
        assert_bitwise(y, a2a.fast_decode(a2a.fast_encode(x.to(DEVICE), eager), eager), f"replay {seed}")


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_permute_without_waiting_matches_cpu(name):
    # permute(wait=False): T*k rows, the packed offsets made on the device by cap_kernel's block scan.
    T, k, E, index_dtype, _, unrouted, skew = ROUTE_CASES[name]
    indices = make_indices(T, k, E, dtype=index_dtype, unrouted=unrouted, skew=skew)
    x = make_data((T, 40), torch.float32, 3)
    cpu_rows, cpu = a2a.permute(x, indices, E, wait=False)
    gpu_rows, gpu = a2a.permute(x.to(DEVICE), indices.to(DEVICE), E, wait=False)
    assert_same_routing(gpu, cpu)
    assert_bitwise(gpu_rows, cpu_rows, f"{name}: permuted rows")


def test_permute_without_waiting_is_captured_in_a_cuda_graph_and_makes_no_sync():
    # permute(wait=False) + unpermute in one graph, replayed on new indices: what eager gives; eagerly, no sync.
    T, k, E, M = 3000, 2, 16, 64
    static_indices = make_indices(T, k, E, skew=1.0).to(DEVICE)
    static_x = make_data((T, M), torch.float32, 4).to(DEVICE)
    gates = make_data((T, k), torch.float32, 5).abs().to(DEVICE)
    a2a.permute(static_x, static_indices, E, wait=False)  # warm up outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, perm = a2a.permute(static_x, static_indices, E, wait=False)
        a2a.unpermute(rows, perm, gates)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, perm = a2a.permute(static_x, static_indices, E, wait=False)
        y = a2a.unpermute(rows, perm, gates)
    for seed in (1, 2):
        indices = make_indices(T, k, E, skew=float(seed), seed=seed)
        static_indices.copy_(indices)
        graph.replay()
        eager_rows, eager = a2a.permute(static_x, indices.to(DEVICE), E, wait=False)
        assert_bitwise(rows, eager_rows, f"replay {seed}: rows")
        assert_bitwise(y, a2a.unpermute(eager_rows, eager, gates), f"replay {seed}")
        assert perm.num_dropped == 0


# --- encode / decode -----------------------------------------------------------------------


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("M", MODEL_DIMS)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_encode_bitwise_and_decode_close(dtype_name, M, gates):
    dtype = DTYPES[dtype_name]
    T, k, E = (96 if M >= 1000 else 300), 2, 6
    indices = make_indices(T, k, E, unrouted=0.1, skew=1.0, seed=M)
    cpu_routing, gpu_routing = route_both(indices, E, capacity_setting=0.8)
    assert cpu_routing.num_dropped > 0 and int((cpu_routing.counts < cpu_routing.capacity).sum()) > 0
    x = make_data((T, M), dtype, 1)
    g = make_gates(gates, T, k, dtype, M)

    want = a2a.fast_encode(x, cpu_routing, g)
    got = a2a.fast_encode(x.to(DEVICE), gpu_routing, on_device(g))
    assert_bitwise(got, want, "fast_encode")

    want_y = a2a.fast_decode(want, cpu_routing, g)
    got_y = a2a.fast_decode(got, gpu_routing, on_device(g))
    assert_close_sum(got_y, want_y, "fast_decode")


def test_encode_writes_every_row():
    # out= prefilled with NaN: padding and kept rows must all be written.
    T, k, E, M = 500, 2, 8, 96
    indices = make_indices(T, k, E, unrouted=0.2, skew=2.0)
    cpu_routing, gpu_routing = route_both(indices, E, capacity_setting=1.0)
    x = make_data((T, M), torch.float16, 2)
    out = torch.full((E, cpu_routing.capacity, M), float("nan"), dtype=torch.float16, device=DEVICE)
    got = a2a.fast_encode(x.to(DEVICE), gpu_routing, out=out)
    assert_bitwise(got, a2a.fast_encode(x, cpu_routing), "fast_encode into a NaN-filled out")


def test_top_k_above_eight():
    # Token sums with more choices than the kernel keeps in registers.
    T, k, E, M = 400, 10, 16, 40
    indices = make_indices(T, k, E, unrouted=0.1)
    cpu_routing, gpu_routing = route_both(indices, E, capacity_setting=0.9)
    x = make_data((T, M), torch.float32, 3)
    g = make_gates("float32", T, k, torch.float32, 3)
    want = a2a.fast_encode(x, cpu_routing, g)
    got = a2a.fast_encode(x.to(DEVICE), gpu_routing, on_device(g))
    assert_bitwise(got, want, "fast_encode")
    assert_close_sum(
        a2a.fast_decode(got, gpu_routing, on_device(g)), a2a.fast_decode(want, cpu_routing, g), "fast_decode"
    )


def test_no_tokens():
    indices = make_indices(0, 2, 4)
    _, gpu_routing = route_both(indices, 4, capacity=3)
    x = torch.empty(0, 16, device=DEVICE)
    dispatched = a2a.fast_encode(x, gpu_routing)
    assert_bitwise(dispatched, torch.zeros(4, 3, 16), "fast_encode of no tokens")
    assert a2a.fast_decode(dispatched, gpu_routing).shape == (0, 16)


# --- per-expert capacities (the ragged layout) ---------------------------------------------


def per_expert_capacities(indices, E, seed):
    """Capacities around each expert's demand: some 0, some short (drops), some above."""
    demand = torch.bincount(indices[indices >= 0].long().cpu(), minlength=E)
    factor = 0.4 + 1.2 * torch.rand(E, generator=generator(E, seed))
    capacities = (demand.double() * factor).long()
    capacities[seed % E] = 0
    return capacities


@pytest.mark.parametrize("E", (1, 8, 300))
def test_route_per_expert_matches_cpu(E):
    indices = make_indices(4097, 2, E, dtype=torch.int32, unrouted=0.05, skew=1.0, seed=E)
    capacities = per_expert_capacities(indices, E, 1)
    cpu, gpu = route_both(indices, E, capacity=capacities)
    assert gpu.per_expert and gpu.capacity.tolist() == capacities.tolist()
    # Capacities given as a CUDA tensor mean the same.
    assert_same_routing(a2a.route(indices.to(DEVICE), E, capacity=capacities.to(DEVICE)), cpu)


@pytest.mark.parametrize("M", (1, 7, 1000))
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_encode_per_expert_bitwise_and_decode_close(dtype_name, M):
    dtype = DTYPES[dtype_name]
    T, k, E = 500, 2, 9
    indices = make_indices(T, k, E, unrouted=0.1, skew=1.0, seed=M)
    capacities = per_expert_capacities(indices, E, M)
    cpu_routing, gpu_routing = route_both(indices, E, capacity=capacities)
    assert cpu_routing.num_dropped > 0 and bool((cpu_routing.counts < capacities).any())
    x = make_data((T, M), dtype, 5)
    g = make_gates("float32", T, k, dtype, M)
    out = torch.full((cpu_routing.num_rows, M), float("nan"), dtype=dtype, device=DEVICE)  # every row written
    want = a2a.fast_encode(x, cpu_routing, g)
    got = a2a.fast_encode(x.to(DEVICE), gpu_routing, on_device(g), out=out)
    assert got.shape == (cpu_routing.num_rows, M)
    assert_bitwise(got, want, "fast_encode (per-expert capacities)")
    assert_close_sum(a2a.fast_decode(got, gpu_routing, on_device(g)), a2a.fast_decode(want, cpu_routing, g),
                     "fast_decode (per-expert capacities)")


def test_per_expert_gradients_match_cpu():
    T, k, E, M = 300, 2, 6, 24
    indices = make_indices(T, k, E, unrouted=0.1, skew=1.0)
    cpu_routing, gpu_routing = route_both(indices, E, capacity=per_expert_capacities(indices, E, 2))
    results = []
    for routing, device in ((cpu_routing, "cpu"), (gpu_routing, DEVICE)):
        x = make_data((T, M), torch.float64, 6).to(device).requires_grad_()
        g = make_gates("same", T, k, torch.float64, 6).to(device).requires_grad_()
        y = a2a.torch.fast_decode(torch.tanh(a2a.torch.fast_encode(x, routing)), routing, g)
        y.square().sum().backward()
        results.append((y.detach().cpu(), x.grad.cpu(), g.grad.cpu()))
    for got, want, what in zip(results[1], results[0], ("y", "x.grad", "gates.grad")):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, w=what: f"{w}: {m}")


# --- permute / unpermute -------------------------------------------------------------------


@pytest.mark.parametrize("M", (1, 7, 1000))
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_permute_bitwise_and_unpermute_close(dtype_name, M):
    dtype = DTYPES[dtype_name]
    T, k, E = 700, 2, 12
    indices = make_indices(T, k, E, unrouted=0.15, skew=1.0, seed=M)
    x = make_data((T, M), dtype, 4)
    want_sorted, want_perm = a2a.permute(x, indices, E)
    got_sorted, got_perm = a2a.permute(x.to(DEVICE), indices.to(DEVICE), E)
    assert_same_routing(got_perm, want_perm)
    assert got_perm.capacity is None
    assert_bitwise(got_sorted, want_sorted, "permute")
    for gates in ("none", "float32", "same"):
        g = make_gates(gates, T, k, dtype, M)
        assert_close_sum(
            a2a.unpermute(got_sorted, got_perm, on_device(g)),
            a2a.unpermute(want_sorted, want_perm, g),
            f"unpermute {gates}",
        )


# --- gradients -----------------------------------------------------------------------------


def _forward(op, data, gates, routing):
    if op == "encode":
        return a2a.fast_encode(data, routing, gates)
    if op == "decode":
        return a2a.fast_decode(data, routing, gates)
    if op == "permute":
        return a2a.torch.permute(data, routing)[0]
    return a2a.unpermute(data, routing, gates)


def _dot_magnitude(op, data, upstream, routing):
    """sum_i |a_i * b_i| of each gate gradient's dot product, in float64 (CPU)."""
    if op == "encode":  # dot(x[t], grad_rows[row])
        tokens, rows = data, upstream.reshape(-1, data.shape[1])
    else:  # dot(grad_y[t], rows[row])
        tokens, rows = upstream, data.reshape(-1, upstream.shape[1])
    row_map = routing.row_map
    safe = row_map.clamp(min=0)
    products = tokens.double().abs()[:, None, :] * rows.double().abs()[safe]
    return torch.where(row_map >= 0, products.sum(-1), torch.zeros(()))


@pytest.mark.parametrize("op", ["encode", "decode", "permute", "unpermute"])
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
def test_gradients_match_cpu(dtype_name, op):
    dtype = DTYPES[dtype_name]
    T, k, E, M = 400, 2, 8, 1000
    indices = make_indices(T, k, E, unrouted=0.1, skew=1.0)
    if op in ("encode", "decode"):
        cpu_routing, gpu_routing = route_both(indices, E, capacity_setting=0.8)
        rows = E * cpu_routing.capacity
    else:
        _, cpu_routing = a2a.permute(torch.zeros(T, 1), indices, E)
        _, gpu_routing = a2a.permute(torch.zeros(T, 1, device=DEVICE), indices.to(DEVICE), E)
        assert_same_routing(gpu_routing, cpu_routing)
        rows = cpu_routing.num_rows
    if op == "encode" or op == "permute":
        data = make_data((T, M), dtype, 5)
    elif op == "decode":
        data = make_data((E, cpu_routing.capacity, M), dtype, 5)
    else:
        data = make_data((rows, M), dtype, 5)
    gates = (
        None
        if op == "permute"
        else make_gates("float32" if dtype == torch.bfloat16 else "same", T, k, dtype, 5)
    )

    results = {}
    for device, routing in (("cpu", cpu_routing), (DEVICE, gpu_routing)):
        d = data.to(device, copy=True).requires_grad_()
        g = None if gates is None else gates.to(device, copy=True).requires_grad_()
        out = _forward(op, d, g, routing)
        upstream = make_data(tuple(out.shape), dtype, 6).to(device)
        out.backward(upstream)
        results[device] = (out.detach(), d.grad, None if g is None else g.grad, upstream.cpu())

    out_cpu, data_grad_cpu, gate_grad_cpu, upstream = results["cpu"]
    out_gpu, data_grad_gpu, gate_grad_gpu, _ = results[DEVICE]
    # One product per element where the op dispatches (bitwise), a sum where it combines.
    if op in ("encode", "permute"):
        assert_bitwise(out_gpu, out_cpu, f"{op} forward")
        assert_close_sum(data_grad_gpu, data_grad_cpu, f"{op} data gradient")
    else:
        assert_close_sum(out_gpu, out_cpu, f"{op} forward")
        assert_bitwise(data_grad_gpu, data_grad_cpu, f"{op} data gradient")
    if gates is not None:
        assert gate_grad_gpu.dtype == gates.dtype and gate_grad_gpu.device.type == DEVICE
        magnitude = _dot_magnitude(op, data, upstream, cpu_routing)
        assert_close_dot(gate_grad_gpu, gate_grad_cpu, magnitude, M, f"{op} gate gradient")


# --- alignment -----------------------------------------------------------------------------


def unaligned(shape, dtype, offset=1, fill=None):
    """A contiguous CUDA tensor whose data starts `offset` elements past a
    16-byte boundary (a slice of a bigger buffer)."""
    count = 1
    for n in shape:
        count *= n
    big = torch.empty(count + offset + 8, dtype=dtype, device=DEVICE)
    view = big[offset : offset + count].view(*shape)
    if fill is not None:
        view.copy_(fill)
    return view


@pytest.mark.parametrize("M", (7, 8, 1000))
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
def test_unaligned_inputs_and_outputs(dtype_name, M):
    dtype = DTYPES[dtype_name]
    T, k, E = 200, 2, 4
    indices = make_indices(T, k, E, unrouted=0.1, skew=1.0, seed=M)
    cpu_routing, gpu_routing = route_both(indices, E, capacity_setting=0.9)
    C = cpu_routing.capacity
    x = make_data((T, M), dtype, 7)
    g = make_gates("float32", T, k, dtype, 7)
    want = a2a.fast_encode(x, cpu_routing, g)
    x_dev = unaligned((T, M), dtype, fill=x)
    g_dev = unaligned((T, k), torch.float32, fill=g)
    assert x_dev.is_contiguous() and x_dev.data_ptr() % 16 != 0

    # Unaligned source, aligned destination: the rows cannot share vectors.
    assert_bitwise(a2a.fast_encode(x_dev, gpu_routing, g_dev), want, "fast_encode, unaligned x")
    # Source and destination off by the same amount: a scalar head, then vectors.
    out = unaligned((E, C, M), dtype)
    assert_bitwise(a2a.fast_encode(x_dev, gpu_routing, g_dev, out=out), want, "fast_encode, both unaligned")

    want_y = a2a.fast_decode(want, cpu_routing, g)
    dispatched = unaligned((E, C, M), dtype, fill=want.to(DEVICE))
    assert_close_sum(a2a.fast_decode(dispatched, gpu_routing, g_dev), want_y, "fast_decode, unaligned input")
    y_out = unaligned((T, M), dtype)
    assert_close_sum(
        a2a.fast_decode(dispatched, gpu_routing, g_dev, out=y_out),
        want_y,
        "fast_decode, unaligned input and output",
    )

    # Gradients through unaligned leaves: the gate gradient's dot products
    # read unaligned tokens.
    base = torch.zeros(T * M + 1, dtype=dtype, device=DEVICE)
    base[1:].copy_(x.flatten())
    base.requires_grad_()
    g_leaf = g.detach().to(DEVICE, copy=True).requires_grad_()
    x_view = base[1:].view(T, M)
    upstream = make_data((E, C, M), dtype, 8)
    a2a.fast_encode(x_view, gpu_routing, g_leaf).backward(
        unaligned((E, C, M), dtype, fill=upstream.to(DEVICE))
    )
    x_cpu, g_cpu = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    a2a.fast_encode(x_cpu, cpu_routing, g_cpu).backward(upstream)
    assert_close_sum(base.grad[1:].view(T, M), x_cpu.grad, "data gradient, unaligned")
    magnitude = _dot_magnitude("encode", x, upstream, cpu_routing)
    assert_close_dot(g_leaf.grad, g_cpu.grad, magnitude, M, "gate gradient, unaligned")


# --- streams -------------------------------------------------------------------------------


def test_kernels_run_on_the_current_stream():
    """Inputs produced late on a side stream (after a long sleep there) must
    be what the kernels read: they are ordered on that stream."""
    T, k, E, M = 5000, 2, 16, 256
    indices = make_indices(T, k, E, unrouted=0.05, skew=1.0)
    x = make_data((T, M), torch.float32, 9)
    g = make_gates("float32", T, k, torch.float32, 9)
    cpu_routing = a2a.route(indices, E, capacity_setting=1.0)
    want = a2a.fast_encode(x * 2, cpu_routing, g)
    want_y = a2a.fast_decode(want, cpu_routing, g)

    indices_dev, x_dev, g_dev = indices.to(DEVICE), x.to(DEVICE), g.to(DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(100_000_000)  # tens of milliseconds of GPU time before the inputs exist
        late_indices = indices_dev + 0
        late_x = x_dev * 2
        routing = a2a.route(late_indices, E, capacity_setting=1.0)
        dispatched = a2a.fast_encode(late_x, routing, g_dev)
        y = a2a.fast_decode(dispatched, routing, g_dev)
    side.synchronize()
    assert_same_routing(routing, cpu_routing)
    assert_bitwise(dispatched, want, "fast_encode on a side stream")
    assert_close_sum(y, want_y, "fast_decode on a side stream")


def test_cupy_arrays_match_torch_cuda():
    # The same kernels reached through CuPy arrays (their own stream, outputs
    # as CuPy arrays) give the bits of the torch CUDA path.
    cupy = pytest.importorskip("cupy")
    tokens, top_k, experts, model_dim = 300, 2, 8, 64
    g = generator(41)
    idx = torch.randint(-1, experts, (tokens, top_k), generator=g)
    x = torch.randn(tokens, model_dim, generator=g)
    gates = torch.rand(tokens, top_k, generator=g)
    scores = torch.rand(tokens, generator=g)

    def both(make):
        return make(lambda t: t.to(DEVICE)), make(lambda t: cupy.asarray(t.numpy()))

    def same(want, got, what):
        assert isinstance(got, cupy.ndarray), what
        assert (cupy.asnumpy(got) == want.cpu().numpy()).all(), what

    routings = both(lambda f: a2a.route(f(idx), experts, scores=f(scores), batch_prioritized=True))
    same(routings[0].locations, routings[1].locations, "route locations")
    same(routings[0].row_map, routings[1].row_map, "row_map")
    assert (routings[0].capacity, routings[0].num_dropped) == (routings[1].capacity, routings[1].num_dropped)
    to_torch, to_cupy = (lambda t: t.to(DEVICE)), (lambda t: cupy.asarray(t.numpy()))
    encoded = [a2a.fast_encode(f(x), r, f(gates)) for f, r in zip((to_torch, to_cupy), routings)]
    same(encoded[0], encoded[1], "fast_encode")
    decoded = [a2a.fast_decode(e, r) for e, r in zip(encoded, routings)]
    same(decoded[0], decoded[1], "fast_decode")
    permuted = both(lambda f: a2a.permute(f(x), f(idx), experts))
    same(permuted[0][0], permuted[1][0], "permute")
    same(
        a2a.unpermute(permuted[0][0], permuted[0][1], gates.to(DEVICE)),
        a2a.unpermute(permuted[1][0], permuted[1][1], cupy.asarray(gates.numpy())),
        "unpermute",
    )


def test_a2a_takes_torch_current_stream_of_each_device():
    """The stream a2a's kernels run on is torch's current one, whichever way a2a asks for it (torch's raw
    accessor where it has one): the default stream, and a side stream inside torch.cuda.stream."""
    from a2a._arrays import _torch_stream

    device = torch.cuda.current_device()
    assert _torch_stream(device) == torch.cuda.current_stream(device).cuda_stream
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        assert _torch_stream(device) == side.cuda_stream != torch.cuda.default_stream(device).cuda_stream
