"""Test scaffolding until the uneven collectives land on main: stand-ins of
a2a.all_gather_v, a2a.reduce_scatter_v and their a2a.torch autograd
versions, with the signatures of the issue's contract, made of a2a's even
collectives on blocks padded to the largest count (differentiable torch
ops around a2a.torch's all_gather / reduce_scatter). :func:`install` sets
only what a2a lacks, so the real ones win once they exist."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import a2a
import a2a.torch as a2a_torch


def _padded_blocks(x, counts, most):
    return [F.pad(block, (0, 0) * (x.dim() - 1) + (0, most - block.shape[0])) for block in torch.split(x, counts)]


def _gather_v(x, counts, comm, gather):
    counts = [int(c) for c in counts]
    most = max(max(counts), 1)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0]))
    gathered = gather(padded.contiguous(), comm=comm)
    return torch.cat([gathered[i * most : i * most + c] for i, c in enumerate(counts)])


def _scatter_v(x, counts, comm, scatter):
    counts = [int(c) for c in counts]
    most = max(max(counts), 1)
    stacked = torch.cat(_padded_blocks(x, counts, most))
    return scatter(stacked.contiguous(), comm=comm)[: counts[comm.rank]]


def all_gather_v(x, counts, *, comm, out=None):
    result = _gather_v(torch.as_tensor(x), counts, comm, a2a.all_gather)
    if out is None:
        return result
    out.copy_(result)
    return out


def reduce_scatter_v(x, counts, *, comm, op="sum", out=None):
    assert op == "sum"
    result = _scatter_v(torch.as_tensor(x), counts, comm, a2a.reduce_scatter)
    if out is None:
        return result
    out.copy_(result)
    return out


def torch_all_gather_v(x, counts, *, comm):
    return _gather_v(x, counts, comm, a2a_torch.all_gather)


def torch_reduce_scatter_v(x, counts, *, comm, op="sum"):
    assert op == "sum"
    return _scatter_v(x, counts, comm, a2a_torch.reduce_scatter)


def install() -> list[str]:
    """Sets the stand-ins a2a lacks; returns their names."""
    installed = []
    for module, name, function in [(a2a, "all_gather_v", all_gather_v),
                                   (a2a, "reduce_scatter_v", reduce_scatter_v),
                                   (a2a_torch, "all_gather_v", torch_all_gather_v),
                                   (a2a_torch, "reduce_scatter_v", torch_reduce_scatter_v)]:
        if not hasattr(module, name):
            setattr(module, name, function)
            installed.append(f"{module.__name__}.{name}")
    return installed
