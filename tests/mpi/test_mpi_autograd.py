"""Autograd of the collectives under mpirun (a2a.torch, and a2a's own
functions on tensors that require grad), in float64 on per-rank data.

Three checks per case:

- the adjoint identity: with y = A x and any g, sum over ranks of <y, g>
  equals the sum over ranks of <x, A^T g>, where A^T g is what backward
  computes (the sums through a2a.all_reduce);
- torch.autograd.gradcheck (fast mode). Run as it is on every rank, it would
  compare each rank's numerical derivative (moved by every rank's
  perturbation at once) with that rank's share of the backward, which are
  equal only summed over ranks. So it checks the whole collective as one
  function of one replicated input, the concatenation of every rank's x
  (each rank cuts out its own, and the gradient is summed over ranks), with
  one replicated output, every rank's y gathered (the backward keeps this
  rank's part). Input and output shapes are then equal on every rank, so
  gradcheck's vectors and its number of evaluations, each collective, are too;
- double backward: the gradient of <A^T g, w> with respect to g is A w.

Every rank runs every collective of a test before asserting anything.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from a2a_mpi_util import check_2dh_rejected, outcome, regular

import a2a

torch = pytest.importorskip("torch")
import a2a.torch as a2a_torch


@dataclass
class Case:
    in_shapes: list[tuple[int, ...]]  # x's shape on each rank
    out_shapes: list[tuple[int, ...]]  # y's
    call: Callable  # (x, comm) -> y; records when x requires grad
    algo: str = "linear"


def equal(world: int, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [shape] * world


def all_to_all(algo: str) -> Callable[[int], Case]:
    def make(world):
        shape = (3 * world, 2)  # 3 rows per block
        return Case(equal(world, shape), equal(world, shape), lambda x, c: a2a.all_to_all(x, comm=c, algo=algo), algo)

    return make


def flex(base: tuple[int, ...], split_axis: int, concat_axis: int, algo: str = "linear") -> Callable[[int], Case]:
    def make(world):
        shape = list(base)
        shape[split_axis] *= world
        out = list(shape)
        out[split_axis] //= world
        out[concat_axis] *= world

        def call(x, comm):
            return a2a_torch.all_to_all_flex(x, comm=comm, split_axis=split_axis, concat_axis=concat_axis, algo=algo)

        return Case(equal(world, tuple(shape)), equal(world, tuple(out)), call, algo)

    return make


def v_counts(pattern: str, world: int) -> np.ndarray:
    """counts[r, i]: rows rank r sends to rank i; zeros included. "edges":
    rank 0 sends nothing and the last rank receives nothing."""
    r, i = np.meshgrid(np.arange(world), np.arange(world), indexing="ij")
    counts = (2 * r + 3 * i + 1) % 4
    if pattern == "edges":
        counts[0, :] = 0
        counts[:, world - 1] = 0
    return counts.astype(np.int64)


def all_to_all_v(pattern: str, algo: str = "linear") -> Callable[[int], Case]:
    def make(world):
        counts = v_counts(pattern, world)
        ins = [(int(counts[r].sum()), 3) for r in range(world)]
        outs = [(int(counts[:, r].sum()), 3) for r in range(world)]

        def call(x, comm):
            return a2a.all_to_all_v(x, counts[comm.rank].tolist(), comm=comm, algo=algo)[0]

        return Case(ins, outs, call, algo)

    return make


def all_gather(world):
    return Case(equal(world, (3, 2)), equal(world, (3 * world, 2)), lambda x, c: a2a_torch.all_gather(x, comm=c))


def all_gather_into_out(world):
    """out= receives the rows and the call still records autograd."""
    def call(x, c):
        out = torch.full((3 * world, 2), float("nan"), dtype=x.dtype)
        y = a2a_torch.all_gather(x, comm=c, out=out)
        assert y.data_ptr() == out.data_ptr()
        return y

    return Case(equal(world, (3, 2)), equal(world, (3 * world, 2)), call)


def reduce_scatter(world):
    return Case(equal(world, (3 * world, 2)), equal(world, (3, 2)), lambda x, c: a2a.reduce_scatter(x, comm=c))


def dense_v_counts(pattern: str, world: int) -> list[int]:
    """Rows per rank: odd counts with a zero from 3 ranks on ("odd"), or
    everything on the last rank ("last")."""
    if pattern == "last":
        return [0] * (world - 1) + [3]
    return [(2 * r + 1) % 5 for r in range(world)]


def all_gather_v(pattern: str) -> Callable[[int], Case]:
    def make(world):
        counts = dense_v_counts(pattern, world)
        ins = [(counts[r], 2) for r in range(world)]
        return Case(ins, equal(world, (sum(counts), 2)), lambda x, c: a2a.all_gather_v(x, counts, comm=c))

    return make


def reduce_scatter_v(pattern: str) -> Callable[[int], Case]:
    def make(world):
        counts = dense_v_counts(pattern, world)
        outs = [(counts[r], 2) for r in range(world)]
        return Case(equal(world, (sum(counts), 2)), outs, lambda x, c: a2a_torch.reduce_scatter_v(x, counts, comm=c))

    return make


def all_reduce(world):
    return Case(equal(world, (3, 2)), equal(world, (3, 2)), lambda x, c: a2a.all_reduce(x, comm=c))


CASES = {
    "all_to_all": all_to_all("linear"),
    "all_to_all-2dh": all_to_all("2dh"),
    "flex-0-1": flex((3, 1, 2), 0, 1),
    "flex-1-0": flex((3, 1, 2), 1, 0),
    "flex-0-2": flex((1, 3, 2), 0, 2),
    "flex-2-0": flex((3, 1, 1), 2, 0),
    "flex-1-2": flex((2, 3, 1), 1, 2),
    "flex-2-1": flex((1, 3, 1), 2, 1),
    "flex-1-1": flex((2, 1, 3), 1, 1),
    "flex-2d-1-0": flex((3, 1), 1, 0),
    "flex-0-1-2dh": flex((3, 1, 2), 0, 1, "2dh"),
    "v": all_to_all_v("mod"),
    "v-edges": all_to_all_v("edges"),
    "v-2dh": all_to_all_v("mod", "2dh"),
    "v-edges-2dh": all_to_all_v("edges", "2dh"),
    "all_gather": all_gather,
    "all_gather-out": all_gather_into_out,
    "reduce_scatter": reduce_scatter,
    "all_gather_v": all_gather_v("odd"),
    "all_gather_v-last": all_gather_v("last"),
    "reduce_scatter_v": reduce_scatter_v("odd"),
    "reduce_scatter_v-last": reduce_scatter_v("last"),
    "all_reduce": all_reduce,
}


def data(tag: str, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    rng = np.random.default_rng([zlib.crc32(tag.encode()), rank, *shape])
    return torch.from_numpy(rng.standard_normal(shape))


def case_for(comm, name: str, *, skip_2dh: bool) -> Case:
    case = CASES[name](comm.size)
    if skip_2dh and case.algo == "2dh" and not regular(comm):
        pytest.skip("algo=2dh needs nodes of equal size")  # the same on every rank
    return case


@pytest.mark.parametrize("name", list(CASES))
def test_autograd_adjoint(comm, name):
    case = case_for(comm, name, skip_2dh=False)
    rank = comm.rank
    x = data(name, rank, case.in_shapes[rank]).requires_grad_()
    g = data(name + "/g", rank, case.out_shapes[rank])
    if case.algo == "2dh" and not regular(comm):
        check_2dh_rejected(outcome(lambda: case.call(x, comm))[1])
        return
    y = case.call(x, comm)
    (grad,) = torch.autograd.grad(y, x, g)
    with torch.no_grad():
        plain = case.call(x, comm)
    local = np.array([float((y.detach() * g).sum()), float((x.detach() * grad).sum())])
    total = a2a.all_reduce(local, comm=comm)

    assert y.requires_grad and tuple(y.shape) == case.out_shapes[rank]
    assert torch.equal(y.detach(), plain)
    assert grad.shape == x.shape and grad.dtype == x.dtype
    assert total[0] == pytest.approx(total[1], rel=1e-12, abs=1e-12), f"<Ax, g> = {total[0]}, <x, A^T g> = {total[1]}"


class _Replicated(torch.autograd.Function):
    """The same X on every rank; its gradient is summed over ranks, so that
    every rank holds the gradient of the whole."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return a2a.all_reduce(grad.detach().contiguous(), comm=ctx.comm), None


class _GatheredFlat(torch.autograd.Function):
    """Every rank's y, flattened and concatenated in rank order, on every
    rank; its gradient (equal on every rank) gives each rank its own part."""

    @staticmethod
    def forward(ctx, y, comm, sizes):
        ctx.shape, ctx.start = y.shape, sum(sizes[: comm.rank])
        width = max(sizes)
        padded = torch.zeros(width, dtype=y.dtype)
        padded[: y.numel()] = y.reshape(-1)
        gathered = a2a.all_gather(padded, comm=comm)
        return torch.cat([gathered[r * width : r * width + size] for r, size in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.shape.numel()].reshape(ctx.shape), None, None


@pytest.mark.parametrize("name", list(CASES))
def test_autograd_gradcheck(comm, name):
    case = case_for(comm, name, skip_2dh=True)
    in_sizes = [int(np.prod(s)) for s in case.in_shapes]
    out_sizes = [int(np.prod(s)) for s in case.out_shapes]
    start = sum(in_sizes[: comm.rank])
    everyone = torch.cat([data(name, r, s).reshape(-1) for r, s in enumerate(case.in_shapes)])

    def whole(x_all):
        mine = _Replicated.apply(x_all, comm)[start : start + in_sizes[comm.rank]]
        y = case.call(mine.reshape(case.in_shapes[comm.rank]).contiguous(), comm)
        return _GatheredFlat.apply(y, comm, out_sizes)

    assert torch.autograd.gradcheck(whole, (everyone.requires_grad_(),), fast_mode=True)


@pytest.mark.parametrize("name", list(CASES))
def test_autograd_double_backward(comm, name):
    case = case_for(comm, name, skip_2dh=True)
    rank = comm.rank
    x = data(name, rank, case.in_shapes[rank]).requires_grad_()
    g = data(name + "/g", rank, case.out_shapes[rank]).requires_grad_()
    w = data(name + "/w", rank, case.in_shapes[rank])
    y = case.call(x, comm)
    (grad_x,) = torch.autograd.grad(y, x, g, create_graph=True)  # A^T g, recorded
    (grad_g,) = torch.autograd.grad(grad_x, g, w)  # A w
    with torch.no_grad():
        expected = case.call(w, comm)

    torch.testing.assert_close(grad_g, expected)
