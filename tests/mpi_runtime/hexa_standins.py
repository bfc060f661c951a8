"""Test scaffolding until the real operators land on main: pure-torch
stand-ins of the ES operators (a2a.es_index, esmm, ess, estmm) and of the
uneven collectives (a2a.all_gather_v, reduce_scatter_v and their a2a.torch
autograd versions), with the signatures of /work/helpers/HEXA_CONTRACT.md.
:func:`install` sets only what a2a lacks, so the real ones win once they
exist. Written with plain torch ops (differentiable) and a2a's even
collectives padded to the largest count."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import a2a
import a2a.torch as a2a_torch


@dataclass
class StandInIndex:
    indices: torch.Tensor  # (T, k) int64
    num_experts: int
    tile: int = 64

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[0]

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]


def es_index(indices, num_experts, *, tile=64):
    indices = torch.as_tensor(indices).long()
    if indices.numel() and int(indices.max()) >= num_experts:
        raise ValueError(f"es_index: expert index {int(indices.max())} out of range for {num_experts} experts")
    return StandInIndex(indices, num_experts, tile)


def _choice_rows(index: StandInIndex, rows: str, device) -> torch.Tensor:
    choices = torch.arange(index.num_tokens * index.top_k, device=device)
    return choices // index.top_k if rows == "token" else choices


def _per_choice(x, index, rows):
    return x[_choice_rows(index, rows, x.device)]


def esmm(x, w, index, *, bias=None, gates=None, x_rows="token", y_rows="choice", w_layout="nk"):
    flat = index.indices.reshape(-1)
    inputs = _per_choice(x, index, x_rows)
    width = w.shape[1] if w_layout == "nk" else w.shape[2]
    result = x.new_zeros(flat.shape[0], width)
    for expert in range(index.num_experts):
        chosen = (flat == expert).nonzero().view(-1)
        if chosen.numel() == 0:
            continue
        weight = w[expert].t() if w_layout == "nk" else w[expert]
        out = inputs[chosen] @ weight
        if bias is not None:
            out = out + bias[expert]
        result = result.index_add(0, chosen, out)
    if gates is not None:
        result = result * gates.reshape(-1, 1).to(result.dtype)
    if y_rows == "choice":
        return result
    return result.view(index.num_tokens, index.top_k, width).sum(dim=1)


def ess(x, index, *, gates=None, rows="token"):
    flat = index.indices.reshape(-1)
    inputs = _per_choice(x, index, rows)
    if gates is not None:
        inputs = inputs * gates.reshape(-1, 1).to(inputs.dtype)
    out = x.new_zeros(index.num_experts, x.shape[1])
    routed = (flat >= 0).nonzero().view(-1)
    return out.index_add(0, flat[routed], inputs[routed])


def estmm(a, b, index, *, gates=None, a_rows="choice", b_rows="token"):
    flat = index.indices.reshape(-1)
    left, right = _per_choice(a, index, a_rows), _per_choice(b, index, b_rows)
    if gates is not None:
        left = left * gates.reshape(-1, 1).to(left.dtype)
    outs = []
    for expert in range(index.num_experts):
        chosen = (flat == expert).nonzero().view(-1)
        outs.append(left[chosen].t() @ right[chosen])
    return torch.stack(outs)


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
    for module, name, function in [(a2a, "es_index", es_index), (a2a, "esmm", esmm), (a2a, "ess", ess),
                                   (a2a, "estmm", estmm), (a2a, "all_gather_v", all_gather_v),
                                   (a2a, "reduce_scatter_v", reduce_scatter_v),
                                   (a2a_torch, "all_gather_v", torch_all_gather_v),
                                   (a2a_torch, "reduce_scatter_v", torch_reduce_scatter_v)]:
        if not hasattr(module, name):
            setattr(module, name, function)
            installed.append(f"{module.__name__}.{name}")
    return installed
