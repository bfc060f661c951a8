"""Autograd of the MoE kernels (a2a.torch, and a2a's functions on tensors
that require grad): torch.autograd.gradcheck in float64, and float32
gradients against a pure-torch implementation (index_select / index_add) of
the same ops, with dropped and unrouted choices present."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref

import a2a

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch

NUM_TOKENS, TOP_K, NUM_EXPERTS, MODEL_DIM = 12, 2, 3, 4


def make_indices(tag="grad", num_tokens=NUM_TOKENS):
    """(T, k) choices with unrouted ones, as a torch tensor."""
    indices = ref.moe_indices(tag, num_tokens, TOP_K, NUM_EXPERTS, unrouted=0.15, skew=0.8)
    assert (indices < 0).any()
    return torch.from_numpy(indices)


@pytest.fixture(scope="module")
def routing():
    """Capacity 3: the popular experts drop choices."""
    r = a2a.route(make_indices(), NUM_EXPERTS, capacity=3)
    assert r.num_dropped > 0
    return r


@pytest.fixture(scope="module")
def perm():
    _, p = a2a.permute(torch.zeros(NUM_TOKENS, 1), make_indices(), NUM_EXPERTS)
    return p


def randn(*shape, dtype=torch.float64, seed=0, grad=True):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(grad)


def rand_gates(dtype=torch.float64, seed=1, grad=True):
    generator = torch.Generator().manual_seed(seed)
    g = torch.rand(NUM_TOKENS, TOP_K, generator=generator, dtype=torch.float64) + 0.1
    return g.to(dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------
# Pure-torch references: gather with index_select, scatter-add with index_add.


def _kept(row_map):
    flat = row_map.reshape(-1)
    kept = flat >= 0
    tokens = torch.arange(row_map.shape[0]).repeat_interleave(row_map.shape[1])
    return kept, tokens[kept], flat[kept]


def torch_dispatch(x, row_map, num_rows, gates=None):
    kept, tokens, rows = _kept(row_map)
    src = x.index_select(0, tokens)
    if gates is not None:
        src = src * gates.reshape(-1)[kept].unsqueeze(1).to(src.dtype)
    return torch.zeros(num_rows, x.shape[1], dtype=x.dtype).index_add(0, rows, src)


def torch_combine(rows_in, row_map, gates=None):
    kept, tokens, rows = _kept(row_map)
    picked = rows_in.index_select(0, rows)
    if gates is not None:
        picked = picked * gates.reshape(-1)[kept].unsqueeze(1).to(picked.dtype)
    return torch.zeros(row_map.shape[0], rows_in.shape[1], dtype=rows_in.dtype).index_add(0, tokens, picked)


def grads(fn, inputs, weight):
    """Gradients of sum(fn(*inputs) * weight) with respect to `inputs`."""
    out = fn(*inputs)
    (out * weight).sum().backward()
    result = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), result


# ---------------------------------------------------------------------------
# gradcheck, float64.


def gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_encode_x_and_gates(routing):
    gradcheck(lambda x, g: a2a_torch.fast_encode(x, routing, g), (randn(NUM_TOKENS, MODEL_DIM), rand_gates()))


def test_gradcheck_encode_x_only(routing):
    gradcheck(lambda x: a2a_torch.fast_encode(x, routing), (randn(NUM_TOKENS, MODEL_DIM),))


def test_gradcheck_encode_gates_only(routing):
    x = randn(NUM_TOKENS, MODEL_DIM, grad=False)
    gradcheck(lambda g: a2a_torch.fast_encode(x, routing, g), (rand_gates(),))


def test_gradcheck_decode_dispatched_and_gates(routing):
    d = randn(NUM_EXPERTS, routing.capacity, MODEL_DIM)
    gradcheck(lambda d, g: a2a_torch.fast_decode(d, routing, g), (d, rand_gates()))


def test_gradcheck_decode_dispatched_only(routing):
    gradcheck(lambda d: a2a_torch.fast_decode(d, routing), (randn(NUM_EXPERTS, routing.capacity, MODEL_DIM),))


def test_gradcheck_permute(perm):
    gradcheck(lambda x: a2a_torch.permute(x, perm)[0], (randn(NUM_TOKENS, MODEL_DIM),))


def test_gradcheck_permute_from_indices():
    indices = make_indices()
    gradcheck(lambda x: a2a_torch.permute(x, indices, NUM_EXPERTS)[0], (randn(NUM_TOKENS, MODEL_DIM),))


def test_gradcheck_unpermute(perm):
    y_sorted = randn(perm.num_rows, MODEL_DIM)
    gradcheck(lambda y, g: a2a_torch.unpermute(y, perm, g), (y_sorted, rand_gates()))


def test_gradcheck_whole_layer(routing):
    """encode -> a nonlinear expert -> decode, gates at decode."""

    def layer(x, g):
        d = a2a_torch.fast_encode(x, routing)
        return a2a_torch.fast_decode(torch.tanh(d) * 2.0, routing, g)

    gradcheck(layer, (randn(NUM_TOKENS, MODEL_DIM), rand_gates()))


def test_gradcheck_through_the_plain_functions(routing, perm):
    """a2a.fast_encode and friends on tensors that require grad."""
    gradcheck(lambda x, g: a2a.fast_encode(x, routing, g), (randn(NUM_TOKENS, MODEL_DIM), rand_gates()))
    gradcheck(lambda d, g: a2a.fast_decode(d, routing, g), (randn(NUM_EXPERTS, 3, MODEL_DIM), rand_gates()))
    gradcheck(lambda y, g: a2a.unpermute(y, perm, g), (randn(perm.num_rows, MODEL_DIM), rand_gates()))
    indices = make_indices()
    gradcheck(lambda x: a2a.permute(x, indices, NUM_EXPERTS)[0], (randn(NUM_TOKENS, MODEL_DIM),))


# ---------------------------------------------------------------------------
# float32 (and 16-bit) gradients against the pure-torch reference.


def check_close(got, want, dtype, what):
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance, msg=what)


@pytest.mark.parametrize("gates", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_gradients_match_torch(routing, dtype, gates):
    gate_dtype = dtype if gates == "same" else torch.float32
    x, g = randn(NUM_TOKENS, MODEL_DIM, dtype=dtype), rand_gates(gate_dtype)
    w = randn(NUM_EXPERTS, 3, MODEL_DIM, seed=7, grad=False)
    out, (gx, gg) = grads(lambda x, g: a2a_torch.fast_encode(x, routing, g), (x, g), w.to(dtype))
    assert gx.dtype == dtype and gg.dtype == gate_dtype
    # The reference in float32 from the same inputs.
    x32, g32 = x.detach().float().requires_grad_(), g.detach().float().requires_grad_()
    rm = torch.as_tensor(ref.as_numpy(routing.row_map))
    out_ref, (gx_ref, gg_ref) = grads(
        lambda x, g: torch_dispatch(x, rm, routing.num_rows, g).view(out.shape),
        (x32, g32),
        w.float().to(dtype).float(),
    )
    check_close(out, out_ref, dtype, "forward")
    check_close(gx, gx_ref, dtype, "grad x")
    check_close(gg, gg_ref, dtype, "grad gates")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_gradients_match_torch(routing, dtype):
    d, g = randn(NUM_EXPERTS, 3, MODEL_DIM, dtype=dtype), rand_gates(dtype)
    w = randn(NUM_TOKENS, MODEL_DIM, seed=8, grad=False).to(dtype)
    out, (gd, gg) = grads(lambda d, g: a2a_torch.fast_decode(d, routing, g), (d, g), w)
    assert gd.dtype == dtype and gg.dtype == dtype and gd.shape == d.shape
    d32, g32 = d.detach().float().requires_grad_(), g.detach().float().requires_grad_()
    rm = torch.as_tensor(ref.as_numpy(routing.row_map))
    out_ref, (gd_ref, gg_ref) = grads(
        lambda d, g: torch_combine(d.view(-1, MODEL_DIM), rm, g), (d32, g32), w.float()
    )
    check_close(out, out_ref, dtype, "forward")
    check_close(gd, gd_ref, dtype, "grad dispatched")
    check_close(gg, gg_ref, dtype, "grad gates")


def test_decode_writes_its_gradient_into_grad_buffer(routing):
    d, g = randn(NUM_EXPERTS, 3, MODEL_DIM, dtype=torch.float32), rand_gates(torch.float32)
    w = randn(NUM_TOKENS, MODEL_DIM, seed=8, grad=False).float()
    _, (gd, gg) = grads(lambda d, g: a2a_torch.fast_decode(d, routing, g), (d, g), w)
    buffer = torch.full((NUM_EXPERTS, 3, MODEL_DIM), float("nan"))
    seen = []
    rows = d * 1.0  # an op before decode: its backward receives the gradient
    rows.register_hook(lambda grad: seen.append(grad.data_ptr()))
    (a2a_torch.fast_decode(rows, routing, g, grad_buffer=buffer) * w).sum().backward()
    assert seen == [buffer.data_ptr()]  # the gradient is the buffer, not a copy of it
    torch.testing.assert_close(buffer, gd, rtol=0, atol=0)  # every row written, the dropped slots zeroed
    torch.testing.assert_close(d.grad, gd, rtol=0, atol=0)
    torch.testing.assert_close(g.grad, gg, rtol=0, atol=0)


@pytest.mark.parametrize("buffer, match", [
    (torch.empty(NUM_EXPERTS, 3, MODEL_DIM, dtype=torch.float64),
     r"\(3, 3, 4\) torch.float64 .* expected a contiguous \(3, 3, 4\) torch.float32"),
    (torch.empty(NUM_EXPERTS, 4, MODEL_DIM), r"is a \(3, 4, 4\)"),
    (torch.empty(NUM_EXPERTS, MODEL_DIM, 3).transpose(1, 2), "non-contiguous"),
    (torch.empty(NUM_EXPERTS, 3, MODEL_DIM, requires_grad=True), "must not require grad"),
    (np.empty((NUM_EXPERTS, 3, MODEL_DIM), np.float32), "must be a torch.Tensor, got ndarray"),
])
def test_a_wrong_grad_buffer_is_refused_at_the_call(routing, buffer, match):
    d = randn(NUM_EXPERTS, 3, MODEL_DIM, dtype=torch.float32)
    with pytest.raises(a2a.InvalidArgumentError, match=f"fast_decode: grad_buffer {match}|fast_decode: .*{match}"):
        a2a_torch.fast_decode(d, routing, grad_buffer=buffer)


def test_a_grad_buffer_over_dispatched_is_refused_where_the_gates_gradient_reads_dispatched(routing):
    d, g = randn(NUM_EXPERTS, 3, MODEL_DIM, dtype=torch.float32), rand_gates(torch.float32)
    with pytest.raises(a2a.InvalidArgumentError, match="fast_decode: grad_buffer overlaps dispatched"):
        a2a_torch.fast_decode(d, routing, g, grad_buffer=d.detach())
    # Without gates the backward never reads dispatched: the buffer may take its place.
    a2a_torch.fast_decode(d, routing, grad_buffer=d.detach()).sum().backward()


def test_permute_unpermute_gradients_match_torch(perm):
    x, g = randn(NUM_TOKENS, MODEL_DIM, dtype=torch.float32), rand_gates(torch.float32)
    rm = torch.as_tensor(ref.as_numpy(perm.row_map))
    w = randn(NUM_TOKENS, MODEL_DIM, seed=9, grad=False).float()

    def ours(x, g):
        x_sorted, _ = a2a_torch.permute(x, perm)
        return a2a_torch.unpermute(torch.sin(x_sorted), perm, g)

    def theirs(x, g):
        return torch_combine(torch.sin(torch_dispatch(x, rm, perm.num_rows)), rm, g)

    out, (gx, gg) = grads(ours, (x, g), w)
    x2, g2 = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    out_ref, (gx_ref, gg_ref) = grads(theirs, (x2, g2), w)
    check_close(out, out_ref, torch.float32, "forward")
    check_close(gx, gx_ref, torch.float32, "grad x")
    check_close(gg, gg_ref, torch.float32, "grad gates")


def test_dropped_and_unrouted_choices_get_zero_gradient(routing):
    x, g = randn(NUM_TOKENS, MODEL_DIM), rand_gates()
    a2a_torch.fast_encode(x, routing, g).sum().backward()
    row_map = ref.as_numpy(routing.row_map)
    not_kept = row_map < 0
    assert not_kept.any()
    assert (g.grad.numpy()[not_kept] == 0).all()
    no_choice = not_kept.all(axis=1)
    assert (x.grad.numpy()[no_choice] == 0).all()
    # A kept choice's gate gradient is the sum of its token (dot with ones).
    kept = ~not_kept
    np.testing.assert_allclose(
        g.grad.numpy()[kept], np.repeat(x.detach().numpy().sum(1)[:, None], 2, 1)[kept]
    )


# ---------------------------------------------------------------------------
# a2a's functions record autograd.


def test_plain_functions_record_autograd(routing, perm):
    x, g = randn(NUM_TOKENS, MODEL_DIM, dtype=torch.float32), rand_gates(torch.float32)
    out = a2a.fast_encode(x, routing, gates=g)
    assert out.requires_grad and out.grad_fn is not None
    y = a2a.fast_decode(out * 3.0, routing)
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None and g.grad is not None
    gx, gg = x.grad.clone(), g.grad.clone()
    # Same as the a2a.torch functions.
    x2, g2 = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    a2a_torch.fast_decode(a2a_torch.fast_encode(x2, routing, g2) * 3.0, routing).sum().backward()
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(gg, g2.grad, rtol=0, atol=0)

    x_sorted, p = a2a.permute(x, make_indices(), NUM_EXPERTS)
    assert x_sorted.requires_grad and isinstance(p, a2a.Routing)
    y = a2a.unpermute(x_sorted, p, gates=g)
    assert y.requires_grad
    y.sum().backward()


def test_only_gates_require_grad(routing):
    x = randn(NUM_TOKENS, MODEL_DIM, dtype=torch.float32, grad=False)
    g = rand_gates(torch.float32)
    out = a2a.fast_encode(x, routing, gates=g)
    assert out.requires_grad
    out.sum().backward()
    assert g.grad is not None and x.grad is None


def test_no_grad_records_nothing(routing):
    x = randn(NUM_TOKENS, MODEL_DIM, dtype=torch.float32)
    with torch.no_grad():
        out = a2a.fast_encode(x, routing)
    assert not out.requires_grad and out.grad_fn is None


def test_out_is_refused_while_recording(routing):
    x = randn(NUM_TOKENS, MODEL_DIM, dtype=torch.float32)
    buf = torch.empty(NUM_EXPERTS, 3, MODEL_DIM)
    with pytest.raises(a2a.InvalidArgumentError, match="out"):
        a2a.fast_encode(x, routing, out=buf)


def test_numpy_inputs_have_no_autograd(routing):
    np_routing = a2a.route(ref.as_numpy(routing.indices), NUM_EXPERTS, capacity=3)
    out = a2a.fast_encode(np.ones((NUM_TOKENS, MODEL_DIM), np.float32), np_routing)
    assert isinstance(out, np.ndarray)
