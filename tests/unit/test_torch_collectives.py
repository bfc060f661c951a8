"""Autograd of the collectives (a2a.torch, and a2a's collectives on tensors
that require grad) on a 1-rank communicator: gradcheck and gradgradcheck in
float64, gradients autograd hands in non-contiguous or expanded, zero-size
inputs, which results require grad, and the errors. On one rank every
collective is the identity (flex a reshape), so a gradient is the upstream
gradient itself; tests/mpi/test_mpi_autograd.py checks the exchanges."""

from __future__ import annotations

import numpy as np
import pytest
from checks import raises_invalid

import a2a

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch

# name -> (input shape, function of (x, comm) through a2a.torch)
OPS = {
    "all_to_all": ((5, 3), lambda x, comm: a2a_torch.all_to_all(x, comm=comm)),
    "all_to_all-2dh": ((5, 3), lambda x, comm: a2a_torch.all_to_all(x, comm=comm, algo="2dh")),
    "flex-0-1": ((3, 2, 4), lambda x, comm: a2a_torch.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1)),
    "flex-2-0-2dh": (
        (3, 2, 4),
        lambda x, comm: a2a_torch.all_to_all_flex(x, comm=comm, split_axis=2, concat_axis=0, algo="2dh"),
    ),
    "flex-negative": ((3, 4), lambda x, comm: a2a_torch.all_to_all_flex(x, comm=comm, split_axis=-1, concat_axis=-2)),
    "all_to_all_v": ((5, 3), lambda x, comm: a2a_torch.all_to_all_v(x, [x.shape[0]], comm=comm)[0]),
    "all_to_all_v-2dh": ((5, 3), lambda x, comm: a2a_torch.all_to_all_v(x, [x.shape[0]], comm=comm, algo="2dh")[0]),
    "all_gather": ((5, 3), lambda x, comm: a2a_torch.all_gather(x, comm=comm)),
    "reduce_scatter": ((5, 3), lambda x, comm: a2a_torch.reduce_scatter(x, comm=comm)),
    "all_gather_v": ((5, 3), lambda x, comm: a2a_torch.all_gather_v(x, [x.shape[0]], comm=comm)),
    "reduce_scatter_v": ((5, 3), lambda x, comm: a2a_torch.reduce_scatter_v(x, [x.shape[0]], comm=comm)),
    "all_reduce": ((5, 3), lambda x, comm: a2a_torch.all_reduce(x, comm=comm)),
}
# The same calls through a2a's own functions, which record by themselves.
PUBLIC = {
    "all_to_all": lambda x, comm: a2a.all_to_all(x, comm=comm),
    "all_to_all_flex": lambda x, comm: a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0),
    "all_to_all_v": lambda x, comm: a2a.all_to_all_v(x, [x.shape[0]], comm=comm)[0],
    "all_gather": lambda x, comm: a2a.all_gather(x, comm=comm),
    "reduce_scatter": lambda x, comm: a2a.reduce_scatter(x, comm=comm),
    "all_gather_v": lambda x, comm: a2a.all_gather_v(x, [x.shape[0]], comm=comm),
    "reduce_scatter_v": lambda x, comm: a2a.reduce_scatter_v(x, torch.tensor([x.shape[0]]), comm=comm),
    "all_reduce": lambda x, comm: a2a.all_reduce(x, comm=comm),
}


@pytest.fixture(params=["cpu", "cuda"])
def device_comm(request, comm):
    """(device, a 1-rank comm for its tensors): the host comm, or a CUDA one
    (NCCL where built) when torch sees a GPU and a2a was built with CUDA."""
    if request.param == "cpu":
        return torch.device("cpu"), comm
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if not a2a.config().get("cuda"):
        pytest.skip("a2a was built without CUDA")
    from mpi4py import MPI

    return torch.device("cuda", torch.cuda.current_device()), a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda")


def randn(shape, seed=0, dtype=torch.float64, device="cpu", grad=True):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).to(device).requires_grad_(grad)


@pytest.mark.parametrize("name", list(OPS))
def test_gradcheck_and_gradgradcheck(device_comm, name):
    device, comm = device_comm
    shape, fn = OPS[name]
    x = randn(shape, device=device)
    assert torch.autograd.gradcheck(lambda t: fn(t, comm), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fn(t, comm), (x,))


@pytest.mark.parametrize("name", list(PUBLIC))
def test_a2a_functions_record_and_match_the_plain_call(comm, name):
    x = randn((4, 2))
    y = PUBLIC[name](x, comm)
    assert y.requires_grad and y.grad_fn is not None
    with torch.no_grad():
        plain = PUBLIC[name](x, comm)
    assert plain.grad_fn is None and not plain.requires_grad
    assert torch.equal(y.detach(), plain)
    assert torch.autograd.gradcheck(lambda t: PUBLIC[name](t, comm), (x,))


@pytest.mark.parametrize("name", list(OPS))
def test_requires_grad_follows_the_input(comm, name):
    shape, fn = OPS[name]
    assert not fn(randn(shape, grad=False), comm).requires_grad
    assert fn(randn(shape), comm).requires_grad
    with torch.no_grad():
        assert not fn(randn(shape), comm).requires_grad
    with torch.inference_mode():
        assert not fn(randn(shape), comm).requires_grad


@pytest.mark.parametrize("name", list(OPS))
def test_non_contiguous_and_expanded_upstream_gradients(device_comm, name):
    device, comm = device_comm
    shape, fn = OPS[name]
    x = randn(shape, device=device)
    y = fn(x, comm)
    # A transposed upstream gradient: strided, not C-contiguous.
    upstream = randn(tuple(reversed(y.shape)), seed=1, device=device, grad=False).permute(
        *reversed(range(y.dim()))
    )
    assert not upstream.is_contiguous()
    (grad,) = torch.autograd.grad(y, x, upstream, retain_graph=True)
    assert grad.device == x.device
    # One rank: the adjoint of every collective (and of flex's reshape) gives
    # the upstream gradient back in x's shape.
    torch.testing.assert_close(grad, upstream.reshape(x.shape), rtol=0, atol=0)
    # y.sum(): an expanded gradient of ones (stride 0).
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)


ZERO_SIZE = {
    "all_to_all": ((0, 3), lambda x, comm: a2a.all_to_all(x, comm=comm)),
    "flex": ((2, 0, 3), lambda x, comm: a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0)),
    "all_to_all_v": ((0, 3), lambda x, comm: a2a.all_to_all_v(x, [0], comm=comm)[0]),
    "all_gather": ((0, 2), lambda x, comm: a2a.all_gather(x, comm=comm)),
    "reduce_scatter": ((0,), lambda x, comm: a2a.reduce_scatter(x, comm=comm)),
    "all_gather_v": ((0, 2), lambda x, comm: a2a.all_gather_v(x, [0], comm=comm)),
    "reduce_scatter_v": ((0,), lambda x, comm: a2a.reduce_scatter_v(x, [0], comm=comm)),
    "all_reduce": ((3, 0), lambda x, comm: a2a.all_reduce(x, comm=comm)),
}


@pytest.mark.parametrize("name", list(ZERO_SIZE))
def test_zero_size(comm, name):
    shape, fn = ZERO_SIZE[name]
    x = randn(shape)
    y = fn(x, comm)
    assert y.requires_grad and y.numel() == 0
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.autograd.gradcheck(lambda t: fn(t, comm), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_gradients_keep_the_dtype(comm, dtype):
    x = randn((6, 2), dtype=dtype)
    y = a2a.all_to_all_flex(a2a.all_gather(x, comm=comm), comm=comm, split_axis=1, concat_axis=0)
    (y * 2).sum().backward()
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, torch.full_like(x, 2))


def test_all_to_all_v_counts_carry_no_gradient(comm):
    x = randn((5, 2))
    recv, recv_counts = a2a_torch.all_to_all_v(x, torch.tensor([5]), comm=comm)
    assert isinstance(recv_counts, np.ndarray) and recv_counts.dtype == np.int64
    assert recv_counts.tolist() == [5]
    recv_counts[0] = 0  # the caller's copy: the backward keeps its own
    recv.backward(torch.ones_like(recv), retain_graph=True)
    recv.backward(torch.ones_like(recv))  # again, through the kept plan
    assert torch.equal(x.grad, torch.full_like(x, 2))


def test_dense_v_backward_keeps_its_own_counts(comm):
    """The caller may reuse its counts list after the forward: the backward
    runs with the counts the forward saw."""
    x = randn((4, 2))
    counts = [4]
    y = a2a.all_gather_v(x, counts, comm=comm)
    z = a2a.reduce_scatter_v(y * 2, counts, comm=comm)
    counts[0] = 0
    z.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2))


def test_double_backward_through_the_collective_backward(comm):
    """create_graph=True records the backward's collectives: the gradient of
    <A^T g, w> with respect to g is A w."""
    x = randn((4, 6))
    y = a2a.all_to_all_flex(x, comm=comm, split_axis=1, concat_axis=0)
    g = randn(tuple(y.shape), seed=1)
    (grad_x,) = torch.autograd.grad(y, x, g, create_graph=True)
    assert grad_x.requires_grad
    w = randn(tuple(x.shape), seed=2, grad=False)
    (grad_g,) = torch.autograd.grad(grad_x, g, w)
    assert torch.equal(grad_g, a2a.all_to_all_flex(w, comm=comm, split_axis=1, concat_axis=0))


def test_numpy_and_plain_tensors_take_the_plain_call(comm):
    x = np.arange(6.0)
    assert isinstance(a2a.all_to_all(x, comm=comm), np.ndarray)
    t = torch.arange(6.0)
    out = torch.empty(6)
    assert a2a.all_to_all(t, comm=comm, out=out) is out
    with torch.no_grad():
        x = randn((6,), dtype=torch.float32)
        assert a2a.all_reduce(x, comm=comm, out=out) is out  # out= is fine without recording


# ---------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "name, call",
    [
        ("all_to_all", lambda x, out, comm: a2a.all_to_all(x, comm=comm, out=out)),
        ("all_to_all_flex", lambda x, out, comm: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0, out=out)),
        ("all_to_all_v", lambda x, out, comm: a2a.all_to_all_v(x, [4], comm=comm, out=out)[0]),
        ("all_gather", lambda x, out, comm: a2a.all_gather(x, comm=comm, out=out)),
        ("reduce_scatter", lambda x, out, comm: a2a.reduce_scatter(x, comm=comm, out=out)),
        ("all_gather_v", lambda x, out, comm: a2a.all_gather_v(x, [4], comm=comm, out=out)),
        ("reduce_scatter_v", lambda x, out, comm: a2a.reduce_scatter_v(x, [4], comm=comm, out=out)),
        ("all_reduce", lambda x, out, comm: a2a.all_reduce(x, comm=comm, out=x)),
    ],
)
def test_out_while_recording(comm, name, call):
    x = randn((4, 2))
    out = torch.empty(4, 2, dtype=torch.float64)
    raises_invalid(lambda: call(x, out, comm), name, "rank 0 of 1", "out= cannot be used while recording autograd")
    with torch.no_grad():
        assert call(x, out, comm) is (x if name == "all_reduce" else out)


def test_all_gather_into_out_records_autograd(comm):
    x = randn((4, 2))
    out = torch.full((4, 2), float("nan"), dtype=torch.float64)
    y = a2a_torch.all_gather(x, comm=comm, out=out)
    assert y.data_ptr() == out.data_ptr() and y.requires_grad and torch.equal(out, x.detach())
    (y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    wanting_grad = torch.empty(4, 2, dtype=torch.float64, requires_grad=True)
    raises_invalid(lambda: a2a_torch.all_gather(x, comm=comm, out=wanting_grad), "all_gather", "rank 0 of 1",
                   "out= must not require grad")


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(
    "name, fn",
    [
        ("all_reduce", lambda x, comm, op: a2a_torch.all_reduce(x, comm=comm, op=op)),
        ("reduce_scatter", lambda x, comm, op: a2a_torch.reduce_scatter(x, comm=comm, op=op)),
        ("reduce_scatter_v", lambda x, comm, op: a2a_torch.reduce_scatter_v(x, [4], comm=comm, op=op)),
        ("reduce_scatter_v", lambda x, comm, op: a2a.reduce_scatter_v(x, [4], comm=comm, op=op)),
        ("all_reduce", lambda x, comm, op: a2a.all_reduce(x, comm=comm, op=op)),
    ],
)
def test_only_the_sum_differentiates(comm, name, fn, op):
    x = randn((4, 2))
    raises_invalid(lambda: fn(x, comm, op), name, "rank 0 of 1", f"op='{op}' has no gradient", "torch.no_grad()")
    for y in (fn(x.detach(), comm, op), fn(randn((4, 2), grad=False), comm, op)):
        assert not y.requires_grad and torch.equal(y, x.detach())
    with torch.no_grad():
        assert torch.equal(fn(x, comm, op), x.detach())


def test_unknown_op_is_reported_by_the_collective(comm):
    raises_invalid(lambda: a2a_torch.all_reduce(randn((3,)), comm=comm, op="prod"), "all_reduce", "unknown op 'prod'")


def test_comm_must_be_a_comm():
    x = randn((4,))
    with pytest.raises(TypeError, match="comm must be an a2a.Comm"):
        a2a.all_to_all(x, comm=None)
    with pytest.raises(TypeError, match="comm must be an a2a.Comm"):
        a2a.all_reduce(x, comm="world", op="max")
    with pytest.raises(TypeError, match="comm must be an a2a.Comm"):
        a2a.all_gather(x, comm=None, out=x)


def test_bad_input_keeps_the_collective_messages(comm):
    x = randn((5, 2))
    raises_invalid(lambda: a2a.all_to_all_v(x, [4], comm=comm), "all_to_all_v", "send_counts sum to 4 rows")
    raises_invalid(lambda: a2a.all_to_all(x.t(), comm=comm), "all_to_all", "not C-contiguous")  # never copied
    raises_invalid(
        lambda: a2a_torch.all_to_all_flex(x, comm=comm, split_axis=2, concat_axis=0), "split_axis=2 is out of range"
    )
    raises_invalid(lambda: a2a_torch.all_to_all(x, comm=comm, algo="ring"), "unknown algo 'ring'")


def test_a_plan_records_no_autograd(comm):
    x = randn((4, 2))
    plan = a2a.plan_v([4], like=x, comm=comm)
    raises_invalid(lambda: plan.run(x), "all_to_all_v", "requires grad while grad mode is on", "a2a.all_to_all_v")
    with torch.no_grad():
        assert torch.equal(plan.run(x), x.detach())
    assert torch.equal(plan.run(x.detach()), x.detach())


def test_comm_still_works_after_the_errors(comm):
    x = randn((4,))
    with pytest.raises(a2a.InvalidArgumentError):
        a2a.all_reduce(x, comm=comm, op="max")
    assert torch.equal(a2a.all_reduce(x, comm=comm).detach(), x.detach())


def test_docstrings_say_the_call_records(comm):
    for name in (
        "all_to_all",
        "all_to_all_flex",
        "all_to_all_v",
        "all_gather",
        "reduce_scatter",
        "all_gather_v",
        "reduce_scatter_v",
        "all_reduce",
    ):
        doc = getattr(a2a, name).__doc__
        assert f"a2a.torch.{name}" in doc and "out=" in doc, name
        assert "Backward (collective)" in getattr(a2a_torch, name).__doc__, name
