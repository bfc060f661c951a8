"""a2a's in-place writes tell autograd, as torch's own in-place ops do: the
version counter of every torch tensor a2a writes (out=, grad_buffer=, a
low-latency buffer's results) goes up. A backward that saved the tensor, or
a view of it or its .detach(), then refuses to run ("modified by an inplace
operation") instead of computing a gradient from what a2a wrote over it.
Before, such a backward ran and returned wrong gradients silently."""

from __future__ import annotations

import pytest

import a2a

torch = pytest.importorskip("torch")
import a2a.torch

STALE = "modified by an inplace operation"


def saved(shape):
    """(buffer, loss): the loss's backward reads `buffer` (the product saved it for w's gradient)."""
    buffer = torch.zeros(shape)
    w = torch.ones(shape, requires_grad=True)
    return buffer, (w * buffer).sum()


def assert_refused_after(op, write, shape, *, through=lambda buffer: buffer):
    """write(through(buffer)) over a saved buffer makes its backward refuse; without the write it runs."""
    buffer, loss = saved(shape)
    before = buffer._version
    write(through(buffer))
    assert buffer._version > before, f"{op} wrote without raising the version"
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()
    _, loss = saved(shape)
    loss.backward()  # the check is the write's, not the test's


def test_the_collectives_writes_bump_the_version(comm):
    x = torch.randn(4, 8)
    calls = {
        "all_to_all": lambda out: a2a.all_to_all(x, comm=comm, out=out),
        "all_to_all_flex": lambda out: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, out=out),
        "all_to_all_v": lambda out: a2a.all_to_all_v(x, [4], comm=comm, out=out),
        "all_gather": lambda out: a2a.all_gather(x, comm=comm, out=out),
        "all_reduce": lambda out: a2a.all_reduce(x, comm=comm, out=out),
        "reduce_scatter": lambda out: a2a.reduce_scatter(x, comm=comm, out=out),
        "all_gather_v": lambda out: a2a.all_gather_v(x, [4], comm=comm, out=out),
        "plan_v(...).run": lambda out: a2a.plan_v([4], like=x, comm=comm).run(x, out=out),
    }
    for op, call in calls.items():
        assert_refused_after(op, call, (4, 8))  # torch's fast path
        # through a view and a detached alias, which share the buffer's version counter
        assert_refused_after(op, call, (32,), through=lambda buffer: buffer.view(4, 8))
        assert_refused_after(op, call, (4, 8), through=lambda buffer: buffer.detach())
    # the general path: an out= that requires grad, written under no_grad, as torch writes it
    def general(out):
        leaf = out.requires_grad_()
        with torch.no_grad():
            a2a.all_to_all(x, comm=comm, out=leaf)
    buffer = torch.zeros(4, 8)
    before = buffer._version
    general(buffer)
    assert buffer._version > before


def test_in_place_reduction_bumps_the_version(comm):
    buffer, loss = saved((4, 8))
    a2a.all_reduce(buffer, comm=comm, out=buffer)
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()


def test_the_moe_kernels_writes_bump_the_version():
    x = torch.randn(4, 8)
    indices = torch.tensor([[0], [1], [0], [1]])
    routing = a2a.route(indices, 2, capacity=2)
    rows, perm = a2a.permute(x, indices, 2)
    gates = torch.ones(4, 1)
    calls = {
        "fast_encode": (lambda out: a2a.fast_encode(x, routing, out=out.view(2, 2, 8)), (4, 8)),
        "a2a.torch.fast_encode": (lambda out: a2a.torch.fast_encode(x, routing, out=out.view(2, 2, 8)), (4, 8)),
        "fast_decode": (lambda out: a2a.fast_decode(x.view(2, 2, 8), routing, gates, out=out), (4, 8)),
        "permute": (lambda out: a2a.permute(x, indices, 2, out=out), (4, 8)),
        "unpermute": (lambda out: a2a.unpermute(rows, perm, gates, out=out), (4, 8)),
        "esmm": (lambda out: a2a.esmm(x, torch.randn(2, 3, 8), a2a.es_index(indices, 2), out=out), (4, 3)),
    }
    for op, (call, shape) in calls.items():
        assert_refused_after(op, call, shape)


def test_the_decode_gradient_buffer_bumps_the_version():
    """grad_buffer= is written in the backward: a tensor saved by another graph sees it."""
    routing = a2a.route(torch.tensor([[0], [1], [0], [1]]), 2, capacity=2)
    dispatched = torch.randn(2, 2, 8, requires_grad=True)
    buffer, loss = saved((2, 2, 8))
    a2a.torch.fast_decode(dispatched, routing, grad_buffer=buffer).sum().backward()
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()


def test_the_fp8_writes_bump_the_version():
    x = torch.randn(4, 128)
    pair = a2a.quantize_fp8(x)
    assert_refused_after("dequantize_fp8", lambda out: a2a.dequantize_fp8(*pair, out=out), (4, 128))
    # quantize's out= pair: the packed rows it views are written
    packed = torch.zeros_like(pair.packed)
    w = torch.ones(packed.shape, requires_grad=True)
    loss = (w * packed).sum()  # saves packed itself (uint8, promoted)
    a2a.quantize_fp8(x, out=a2a.Fp8Pair(*a2a.unpack_fp8(packed, 128), packed))
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()


def test_a_low_latency_dispatch_marks_the_last_results_stale(comm):
    buffer = a2a.LowLatencyBuffer(comm, 4, 8, 2, 2, dtype="float32")
    x, indices = torch.randn(4, 8), torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])
    expert_x, _ = buffer.dispatch(x, indices)
    w = torch.ones(expert_x.shape, requires_grad=True)
    loss = (w * expert_x).sum()  # saves the buffer's rows
    buffer.combine(expert_x.clone())
    expert_x_again, _ = buffer.dispatch(x, indices)
    assert expert_x_again.data_ptr() == expert_x.data_ptr()
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()
    y = buffer.combine(expert_x_again.clone())
    w = torch.ones(y.shape, requires_grad=True)
    loss = (w * y).sum()
    buffer.dispatch(x, indices)
    buffer.combine(expert_x_again.clone())
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()


def test_a_low_latency_buffer_made_under_inference_mode_hands_out_normal_tensors(comm):
    """Its views are written by the calls after it, and may be by the caller, outside that mode."""
    with torch.inference_mode():
        buffer = a2a.LowLatencyBuffer(comm, 4, 8, 2, 2, dtype="float32")
    x, indices = torch.randn(4, 8), torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])
    with torch.no_grad():
        expert_x, counts = buffer.dispatch(x, indices)
        y = buffer.combine(expert_x.clone())
    assert not any(t.is_inference() for t in (expert_x, counts, y))
    y.mul_(2)  # an inference tensor would refuse this outside inference mode
