"""The CUDA kernels of the expert-specific operators (a2a.es_index, esmm, ess,
estmm) against the CPU backend on the same data, with torch CUDA tensors.

The re-index vector must agree exactly, and so must ESS (both backends add
gate * x, the product rounded on its own, in slot order). ESMM and ESTMM are
sums of products taken in a different order (tiles over K, tensor cores for
16-bit floats), so each side is checked against a float64 reference within
the worst-case accumulation error terms * eps * sum |products| plus the
rounding of the result, and the two sides against each other within both
bounds.
Runs on the GPU are bitwise repeatable. Skipped without a GPU or a CUDA build
of a2a (conftest.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_data import DEVICE, DTYPES, STORE_EPS, make_data, make_gates, make_indices, on_device

import a2a

# Half the spacing of each dtype's subnormals: a result that small rounds to
# a multiple of it, whatever its relative error.
SUBNORMAL_STEP = {
    torch.float32: 2.0**-149,
    torch.float64: 0.0,
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
}


def acc_eps(dtype):
    return 2.0**-53 if dtype == torch.float64 else 2.0**-24


def index_both(indices, E, tile):
    """(cpu index, gpu index), checked equal."""
    cpu = a2a.es_index(indices, E, tile=tile)
    gpu = a2a.es_index(indices.to(DEVICE), E, tile=tile)
    for name in ("num_tokens", "top_k", "num_experts", "tile", "num_slots"):
        assert getattr(gpu, name) == getattr(cpu, name), name
    for name in ("slots", "expert_starts", "counts"):
        got, want = getattr(gpu, name), getattr(cpu, name)
        assert got.device.type == DEVICE, f"{name} is on {got.device}"
        assert torch.equal(got.cpu(), want), f"{name}: gpu {got.cpu().tolist()} cpu {want.tolist()}"
    return cpu, gpu


# --- float64 references (plain torch, on the CPU) ------------------------------------------


def row_of(c, k, rows):
    return c // k if rows == "token" else c


def ref_esmm(x, w, indices, bias, gates, x_rows, y_rows, w_layout):
    """y in float64 from float64 copies (pass absolute values for the magnitude)."""
    T, k = indices.shape
    N = w.shape[1] if w_layout == "nk" else w.shape[2]
    flat = indices.reshape(-1)
    g = gates.reshape(-1) if gates is not None else torch.ones(T * k, dtype=torch.float64)
    r = torch.zeros(T * k, N, dtype=torch.float64)
    for e in range(w.shape[0]):
        cs = (flat == e).nonzero().flatten()
        if len(cs) == 0:
            continue
        we = w[e] if w_layout == "kn" else w[e].T  # (K, N)
        out = x[row_of(cs, k, x_rows)] @ we
        if bias is not None:
            out = out + bias[e]
        r[cs] = g[cs, None] * out
    return r if y_rows == "choice" else r.view(T, k, N).sum(1)


def ref_ess(x, indices, gates, rows, E):
    T, k = indices.shape
    flat = indices.reshape(-1)
    g = gates.reshape(-1) if gates is not None else torch.ones(T * k, dtype=torch.float64)
    out = torch.zeros(E, x.shape[1], dtype=torch.float64)
    for e in range(E):
        cs = (flat == e).nonzero().flatten()
        out[e] = (g[cs, None] * x[row_of(cs, k, rows)]).sum(0)
    return out


def ref_estmm(a, b, indices, gates, a_rows, b_rows, E):
    T, k = indices.shape
    flat = indices.reshape(-1)
    g = gates.reshape(-1) if gates is not None else torch.ones(T * k, dtype=torch.float64)
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64)
    for e in range(E):
        cs = (flat == e).nonzero().flatten()
        out[e] = (g[cs, None] * a[row_of(cs, k, a_rows)]).T @ b[row_of(cs, k, b_rows)]
    return out


def f64(t):
    return None if t is None else t.detach().cpu().double()


def abs64(t):
    return None if t is None else t.detach().cpu().double().abs()


def assert_within(got, want_cpu, exact, magnitude, terms, what):
    """got (GPU) and want_cpu (CPU) each within terms * eps * magnitude plus
    the rounding to the dtype of the float64 `exact`, and of each other."""
    assert got.device.type == DEVICE, f"{what} is on {got.device}"
    assert got.dtype == want_cpu.dtype and got.shape == want_cpu.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want_cpu.dtype} {tuple(want_cpu.shape)}"
    )
    dtype = want_cpu.dtype
    # Factor 2: the tensor cores' float32 sums round no worse than twice the serial bound.
    bound = (2 * (terms + 2) * acc_eps(dtype) * magnitude + 2 * STORE_EPS[dtype] * exact.abs()
             + SUBNORMAL_STEP[dtype] / 2 + 1e-300)
    for side, value in (("gpu", got.detach().cpu().double()), ("cpu", want_cpu.double())):
        excess = (value - exact).abs() - bound
        if not bool((excess <= 0).all()):
            at = tuple(excess.argmax().item() // s % n for s, n in zip(strides(exact.shape), exact.shape))
            raise AssertionError(
                f"{what}: {side} exceeds the bound by {excess.max().item():.3g} at {at}: "
                f"{value[at].item()!r} vs exact {exact[at].item()!r}"
            )
    gap = (got.detach().cpu().double() - want_cpu.double()).abs()
    assert bool((gap <= 2 * bound).all()), f"{what}: gpu and cpu differ by {gap.max().item():.3g}"


def strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return list(reversed(out))


# --- the re-index vector -------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,k,E,tile,unrouted,skew",
    [
        (1000, 2, 8, 64, 0.1, 0.0),
        (777, 1, 5, 16, 0.2, 2.0),  # skew: high experts empty
        (513, 3, 300, 64, 0.1, 0.0),  # most experts get a few choices, padded to 64
        (300, 2, 4, 1, 0.0, 0.0),  # no padding at all
        (300, 2, 4, 64, 1.0, 0.0),  # nothing routed
        (0, 2, 4, 64, 0.0, 0.0),  # no tokens
        (70000, 2, 64, 128, 0.05, 1.0),  # many location tiles
    ],
)
def test_es_index_matches_cpu(T, k, E, tile, unrouted, skew):
    for index_dtype in (torch.int32, torch.int64):
        index_both(make_indices(T, k, E, unrouted=unrouted, skew=skew, dtype=index_dtype), E, tile)


# --- ESMM ----------------------------------------------------------------------------------

# name: (T, k, E, K, N, tile, unrouted, skew)
ESMM_SHAPES = {
    "odd-top1": (37, 1, 5, 45, 70, 64, 0.1, 1.0),
    "odd-top2": (37, 2, 5, 45, 70, 64, 0.1, 1.0),
    "tile16-spans-experts": (301, 2, 7, 200, 150, 16, 0.1, 2.0),  # a block's 64 slots cross experts
    "tile24-unaligned": (301, 2, 7, 33, 129, 24, 0.05, 0.5),
    "tile128-big": (700, 2, 8, 256, 264, 128, 0.1, 1.0),  # many K steps, several column tiles
    "k1-K1-N1": (50, 1, 3, 1, 1, 64, 0.2, 0.0),
    "top4-vector-widths": (129, 4, 9, 64, 128, 64, 0.1, 0.0),  # 16-byte loads on every row
}
ESMM_MODES = {  # (x_rows, y_rows, w_layout, bias, gates)
    "fc1": ("token", "choice", "nk", True, "none"),
    "fc2": ("choice", "token", "kn", True, "same"),
    "fc2-float32-gates": ("choice", "token", "kn", False, "float32"),
    "token-to-token-nk": ("token", "token", "nk", True, "float32"),
    "choice-to-choice-kn": ("choice", "choice", "kn", False, "same"),
}


def run_esmm(shape, mode, dtype, seed=0):
    T, k, E, K, N, tile, unrouted, skew = shape
    x_rows, y_rows, w_layout, with_bias, gate_mode = mode
    indices = make_indices(T, k, E, unrouted=unrouted, skew=skew, seed=seed)
    cpu_index, gpu_index = index_both(indices, E, tile)
    x = make_data((T if x_rows == "token" else T * k, K), dtype, 1, seed)
    w = make_data((E, N, K) if w_layout == "nk" else (E, K, N), dtype, 2, seed)
    bias = make_data((E, N), dtype, 3, seed) if with_bias else None
    gates = make_gates(gate_mode, T, k, dtype, seed)
    kwargs = {"x_rows": x_rows, "y_rows": y_rows, "w_layout": w_layout}
    want = a2a.esmm(x, w, cpu_index, bias=bias, gates=gates, **kwargs)
    got = a2a.esmm(x.to(DEVICE), w.to(DEVICE), gpu_index, bias=on_device(bias), gates=on_device(gates), **kwargs)
    exact = ref_esmm(f64(x), f64(w), indices, f64(bias), f64(gates), x_rows, y_rows, w_layout)
    magnitude = ref_esmm(abs64(x), abs64(w), indices, abs64(bias), abs64(gates), x_rows, y_rows, w_layout)
    return got, want, exact, magnitude, K + k


@pytest.mark.parametrize("mode", ESMM_MODES)
@pytest.mark.parametrize("shape", ESMM_SHAPES)
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_esmm_matches_cpu(dtype_name, shape, mode):
    got, want, exact, magnitude, terms = run_esmm(ESMM_SHAPES[shape], ESMM_MODES[mode], DTYPES[dtype_name])
    assert_within(got, want, exact, magnitude, terms, f"esmm {shape} {mode}")


@pytest.mark.parametrize("mode", ["fc1", "fc2"])
def test_esmm_float64(mode):
    got, want, exact, magnitude, terms = run_esmm(ESMM_SHAPES["tile16-spans-experts"], ESMM_MODES[mode],
                                                  torch.float64)
    assert_within(got, want, exact, magnitude, terms, f"esmm float64 {mode}")


@pytest.mark.parametrize("y_rows", ["choice", "token"])
def test_esmm_zeroes_unrouted_rows(y_rows):
    # The result must not depend on what out held (NaN here): the rows of
    # unrouted choices (and of tokens with no routed choice) are zeros.
    T, k, E, K, N = 200, 2, 4, 40, 72
    indices = make_indices(T, k, E, unrouted=0.3)
    indices[:10] = -1  # tokens with no routed choice
    _, gpu_index = index_both(indices, E, 64)
    x = make_data((T, K), torch.float16, 4).to(DEVICE)
    w = make_data((E, N, K), torch.float16, 5).to(DEVICE)
    out = torch.full((T * k if y_rows == "choice" else T, N), float("nan"), device=DEVICE, dtype=torch.float16)
    y = a2a.esmm(x, w, gpu_index, y_rows=y_rows, out=out)
    assert y.data_ptr() == out.data_ptr()
    rows = (indices < 0).reshape(-1) if y_rows == "choice" else (indices < 0).all(1)
    assert bool(rows.any())
    assert bool((y[rows.to(DEVICE)] == 0).all()), "rows of unrouted choices are not zero"
    assert not bool(y.isnan().any())


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_esmm_repeatable(dtype_name):
    dtype = DTYPES[dtype_name]
    T, k, E, K, N = 1000, 2, 8, 96, 200
    indices = make_indices(T, k, E)
    _, gpu_index = index_both(indices, E, 64)
    x = make_data((T * k, K), dtype, 6).to(DEVICE)
    w = make_data((E, K, N), dtype, 7).to(DEVICE)
    g = make_gates("float32", T, k, dtype, 8).to(DEVICE)
    runs = [a2a.esmm(x, w, gpu_index, gates=g, x_rows="choice", y_rows="token", w_layout="kn") for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(other, runs[0]), "two runs of esmm differ"


def test_esmm_zero_sizes():
    E = 3
    for T, K, N in ((0, 8, 8), (20, 0, 8), (20, 8, 0)):
        indices = make_indices(T, 2, E)
        cpu_index, gpu_index = index_both(indices, E, 64)
        x = make_data((T, K), torch.float32, 9)
        w = make_data((E, N, K), torch.float32, 10)
        bias = make_data((E, N), torch.float32, 11)
        for y_rows in ("choice", "token"):
            want = a2a.esmm(x, w, cpu_index, bias=bias, y_rows=y_rows)
            got = a2a.esmm(x.to(DEVICE), w.to(DEVICE), gpu_index, bias=bias.to(DEVICE), y_rows=y_rows)
            assert got.shape == want.shape and torch.equal(got.cpu(), want), f"T={T} K={K} N={N} {y_rows}"


def test_esmm_cuda_graph():
    # No synchronization and no allocation in the kernels: capturable.
    T, k, E, K, N = 256, 2, 4, 64, 96
    indices = make_indices(T, k, E)
    cpu_index, gpu_index = index_both(indices, E, 64)
    x = make_data((T, K), torch.float16, 12)
    w = make_data((E, N, K), torch.float16, 13)
    xd, wd = x.to(DEVICE), w.to(DEVICE)
    a2a.esmm(xd, wd, gpu_index, y_rows="token")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = a2a.esmm(xd, wd, gpu_index, y_rows="token")
    graph.replay()
    torch.cuda.synchronize()
    want = a2a.esmm(x, w, cpu_index, y_rows="token")
    exact = ref_esmm(f64(x), f64(w), indices, None, None, "token", "token", "nk")
    magnitude = ref_esmm(abs64(x), abs64(w), indices, None, None, "token", "token", "nk")
    assert_within(y, want, exact, magnitude, K + k, "esmm replayed from a CUDA graph")


# --- ESS and ESTMM -------------------------------------------------------------------------

# name: (T, k, E, dims, tile, unrouted, skew); dims: N for ess, (A, B) for estmm
SUM_SHAPES = {
    "odd-top1": (37, 1, 5, (45, 70), 64, 0.1, 1.0),
    "odd-top2": (301, 2, 7, (129, 33), 16, 0.1, 2.0),
    "wide": (600, 2, 8, (300, 140), 128, 0.05, 0.0),
    "one-column": (90, 2, 3, (1, 1), 64, 0.2, 0.0),
    "empty-experts": (100, 2, 12, (20, 17), 64, 0.0, 6.0),
}


@pytest.mark.parametrize("gate_mode", ["none", "float32", "same"])
@pytest.mark.parametrize("rows", ["token", "choice"])
@pytest.mark.parametrize("shape", SUM_SHAPES)
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_ess_matches_cpu(dtype_name, shape, rows, gate_mode):
    dtype = DTYPES[dtype_name]
    T, k, E, (N, _), tile, unrouted, skew = SUM_SHAPES[shape]
    indices = make_indices(T, k, E, unrouted=unrouted, skew=skew)
    cpu_index, gpu_index = index_both(indices, E, tile)
    x = make_data((T if rows == "token" else T * k, N), dtype, 20)
    gates = make_gates(gate_mode, T, k, dtype, 21)
    want = a2a.ess(x, cpu_index, gates=gates, rows=rows)
    got = a2a.ess(x.to(DEVICE), gpu_index, gates=on_device(gates), rows=rows)
    exact = ref_ess(f64(x), indices, f64(gates), rows, E)
    magnitude = ref_ess(abs64(x), indices, abs64(gates), rows, E)
    assert_within(got, want, exact, magnitude, int(cpu_index.counts.max()) if T else 0, f"ess {shape} {rows}")
    # Both add gate * x (the product rounded on its own) in slot order: the same bits.
    assert torch.equal(got.cpu(), want), f"ess {shape} {rows}: not bitwise equal to the CPU"


@pytest.mark.parametrize("gate_mode", ["none", "float32", "same"])
@pytest.mark.parametrize("rows", [("choice", "token"), ("token", "choice"), ("choice", "choice")])
@pytest.mark.parametrize("shape", SUM_SHAPES)
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_estmm_matches_cpu(dtype_name, shape, rows, gate_mode):
    dtype = DTYPES[dtype_name]
    T, k, E, (A, B), tile, unrouted, skew = SUM_SHAPES[shape]
    a_rows, b_rows = rows
    indices = make_indices(T, k, E, unrouted=unrouted, skew=skew)
    cpu_index, gpu_index = index_both(indices, E, tile)
    a = make_data((T if a_rows == "token" else T * k, A), dtype, 30)
    b = make_data((T if b_rows == "token" else T * k, B), dtype, 31)
    gates = make_gates(gate_mode, T, k, dtype, 32)
    kwargs = {"a_rows": a_rows, "b_rows": b_rows}
    want = a2a.estmm(a, b, cpu_index, gates=gates, **kwargs)
    got = a2a.estmm(a.to(DEVICE), b.to(DEVICE), gpu_index, gates=on_device(gates), **kwargs)
    exact = ref_estmm(f64(a), f64(b), indices, f64(gates), a_rows, b_rows, E)
    magnitude = ref_estmm(abs64(a), abs64(b), indices, abs64(gates), a_rows, b_rows, E)
    terms = int(cpu_index.counts.max()) + 1 if T else 0
    assert_within(got, want, exact, magnitude, terms, f"estmm {shape} {rows}")


def test_ess_estmm_repeatable():
    T, k, E = 3000, 2, 4
    indices = make_indices(T, k, E)
    _, gpu_index = index_both(indices, E, 64)
    x = make_data((T * k, 257), torch.float32, 40).to(DEVICE)
    b = make_data((T, 65), torch.float32, 41).to(DEVICE)
    g = make_gates("float32", T, k, torch.float32, 42).to(DEVICE)
    first = (a2a.ess(x, gpu_index, gates=g, rows="choice"), a2a.estmm(x, b, gpu_index, gates=g))
    for _ in range(2):
        assert torch.equal(a2a.ess(x, gpu_index, gates=g, rows="choice"), first[0]), "two runs of ess differ"
        assert torch.equal(a2a.estmm(x, b, gpu_index, gates=g), first[1]), "two runs of estmm differ"


# --- the expert FFN with autograd ----------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_expert_ffn_gradients_match_cpu(dtype_name):
    """Tutel's FFN (contract's example) forward and backward: ESMM, ESS and
    ESTMM through a2a.torch's autograd on both backends."""
    dtype = DTYPES[dtype_name]
    T, k, E, M, H = 300, 2, 6, 48, 80
    indices = make_indices(T, k, E, unrouted=0.05, skew=1.0)
    # Relative to each tensor's largest entry: bfloat16 rounds h and relu(h)
    # on both sides, and a one-ulp difference there moves small sums.
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    results = []
    for device in ("cpu", DEVICE):
        index = a2a.es_index(indices.to(device), E)
        leaves = [
            make_data((T, M), dtype, 50),
            make_data((E, H, M), dtype, 51) / M**0.5,
            make_data((E, H), dtype, 52),
            make_data((E, H, M), dtype, 53) / H**0.5,
            make_data((E, M), dtype, 54),
            make_gates("float32", T, k, dtype, 55),
        ]
        x, fc1_w, fc1_b, fc2_w, fc2_b, gates = (t.to(device).requires_grad_() for t in leaves)
        h = a2a.esmm(x, fc1_w, index, bias=fc1_b, x_rows="token", y_rows="choice", w_layout="nk")
        y = a2a.esmm(torch.relu(h), fc2_w, index, bias=fc2_b, gates=gates, x_rows="choice", y_rows="token",
                     w_layout="kn")
        y.float().square().sum().backward()
        results.append([y] + [t.grad for t in (x, fc1_w, fc1_b, fc2_w, fc2_b, gates)])
    names = ("y", "x.grad", "fc1_w.grad", "fc1_b.grad", "fc2_w.grad", "fc2_b.grad", "gates.grad")
    for got, want, what in zip(results[1], results[0], names):
        assert got.device.type == DEVICE, what
        want = want.detach().float()
        atol = rtol * float(want.abs().max()) if want.numel() else rtol
        torch.testing.assert_close(got.detach().cpu().float(), want, rtol=rtol, atol=atol,
                                   msg=lambda m, w=what: f"{w}: {m}")
