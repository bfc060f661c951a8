"""The MoE kernels on torch tensors told without views (a2a/_moe_kernels.py:
_torch_kernel, _torch_out; dispatched_rows): fast_encode into out=,
fast_decode and its backward into grad_buffer= take that path, with the
bits of the NumPy path, and anything unusual takes the general path, which
reports it as before."""

from __future__ import annotations

import numpy as np
import pytest

import a2a
from a2a import _moe_kernels

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch

T, E, K, M, C = 12, 4, 2, 8, 5


def problem():
    generator = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    x = torch.randn(T, M, generator=generator)
    gates = torch.rand(T, K, generator=generator)
    return a2a.route(indices, E, capacity=C, wait=False), x, gates


@pytest.fixture
def no_views(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the general path made a view")

    monkeypatch.setattr(_moe_kernels, "argument_view", refused)


def test_encode_into_out_and_decode_take_the_path_without_views(no_views):
    routing, x, gates = problem()
    out = torch.empty(E, C, M)
    got = a2a.fast_encode(x, routing, gates, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (E, C, M)
    flat = torch.empty(E * C * M)  # any contiguous buffer of the right size, viewed as (E, C, M)
    assert torch.equal(a2a.fast_encode(x, routing, gates, out=flat), got)
    assert a2a.fast_decode(got, routing, gates).shape == (T, M)


def test_the_bits_of_the_numpy_path():
    routing, x, gates = problem()
    out = torch.empty(E, C, M)
    encoded = a2a.fast_encode(x, routing, gates, out=out)
    numpy_routing = a2a.route(routing.indices.numpy(), E, capacity=C, wait=False)
    assert np.array_equal(encoded.numpy(), a2a.fast_encode(x.numpy(), numpy_routing, gates.numpy()))
    assert np.array_equal(a2a.fast_decode(encoded, routing, gates).numpy(),
                          a2a.fast_decode(encoded.numpy(), numpy_routing, gates.numpy()))


def test_a_training_step_with_buffers_makes_no_view(no_views):
    routing, x, gates = problem()
    x.requires_grad_(True)
    gates.requires_grad_(True)
    rows = a2a_torch.fast_encode(x, routing, gates, out=torch.empty(E, C, M))
    grad_buffer = torch.empty(E, C, M)
    y = a2a_torch.fast_decode(rows * 2, routing, gates, grad_buffer=grad_buffer)
    y.square().sum().backward()
    assert x.grad is not None and gates.grad is not None


@pytest.mark.parametrize("out,match", [
    (lambda: torch.empty(E, C, M, dtype=torch.float64), "out is a torch"),
    (lambda: torch.empty(E, C, M + 1), "out is a torch"),
    (lambda: torch.empty(E, M, C).transpose(1, 2), "not C-contiguous"),
    (lambda: torch.empty(E, C, M, requires_grad=True), "out requires grad"),
], ids=["dtype", "size", "transposed", "requires grad"])
def test_an_unusual_out_is_reported_as_before(out, match):
    routing, x, gates = problem()
    with pytest.raises(a2a.InvalidArgumentError, match=match):
        a2a.fast_encode(x, routing, gates, out=out())


def test_an_unusual_dispatched_buffer_is_reported_as_before():
    routing, _, gates = problem()
    with pytest.raises(a2a.InvalidArgumentError, match=r"dispatched must be \(num_experts, capacity, model_dim\)"):
        a2a.fast_decode(torch.empty(E, C + 1, M), routing, gates)
    with pytest.raises(a2a.InvalidArgumentError, match="not C-contiguous"):
        a2a.fast_decode(torch.empty(E, M, C).transpose(1, 2), routing, gates)


@pytest.mark.parametrize("shape", [(E * C, M), (E, C, M)], ids=["rows", "dispatched"])
def test_a_buffer_given_as_out_stays_the_callers_under_autograd(shape):
    """The Function's output is a view of out=, never out itself: autograd would otherwise make the
    caller's buffer its output (requires_grad, a grad_fn), and the next call would refuse it."""
    routing, x, gates = problem()
    x.requires_grad_(True)
    buffer = torch.empty(shape)
    for _ in range(2):
        rows = a2a_torch.fast_encode(x, routing, gates, out=buffer)
        rows.sum().backward()
        assert not buffer.requires_grad and buffer.grad_fn is None and rows.data_ptr() == buffer.data_ptr()
