"""What the kernel benchmark computes with torch alone: its environment
(torch, a2a, the device, the seeded generator), random inputs, the routing
tables of a stable argsort, and from them the torch index-op versions of the
kernels (the baselines, whose results are also the reference the check
compares against) and GShard's dense einsum mask."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import common
from .kernels_sizes import capacity_for

__all__ = ["Config", "Env", "Reference", "random_data", "random_indices", "reference_routing"]


class Env:
    """torch, a2a, the device and helpers shared by all configurations."""

    def __init__(self, args: argparse.Namespace):
        import torch

        import a2a

        self.torch = torch
        self.a2a = a2a
        self.args = args
        self.device = args.device
        self.clock = common.Clock(torch, args.device)
        self.gen = torch.Generator().manual_seed(args.seed)

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def acc_dtype(self, name: str) -> Any:
        return self.torch.float64 if name == "float64" else self.torch.float32

    def to_dev(self, t: Any) -> Any:
        return t.to(self.device) if self.device != "cpu" else t

    def as_torch(self, value: Any) -> Any:
        if isinstance(value, self.torch.Tensor):
            return value.to(self.device)
        return self.to_dev(self.torch.as_tensor(np.asarray(value)))


def random_indices(env: Env, tokens: int, experts: int, top_k: int) -> Any:
    """(T, k) int64: k distinct experts per token, uniformly random."""
    torch = env.torch
    out = torch.empty((tokens, top_k), dtype=torch.int64)
    chunk = 1 << 16
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        out[start : start + n] = torch.rand((n, experts), generator=env.gen).topk(top_k, dim=1).indices
    return env.to_dev(out)


def random_data(env: Env, tokens: int, model_dim: int, dtype: str) -> Any:
    torch = env.torch
    work = torch.float64 if dtype == "float64" else torch.float32
    x = torch.empty((tokens, model_dim), dtype=work).uniform_(-1.0, 1.0, generator=env.gen)
    return env.to_dev(x).to(env.dtype(dtype))


@dataclass
class Reference:
    """Routing tables computed with torch alone (a stable argsort of the choices in Tutel's slot order)."""

    capacity: int
    row_map: Any  # (T, k) int64, -1 when dropped: row in the (E*C, M) buffer
    kept_choices: Any  # flat (t*k + j) of kept choices, in (t, j) order
    kept_rows: Any
    kept_tokens: Any
    order: Any  # dropless: order[r] = j*T + t of the choice at row r
    counts: Any


def reference_routing(env: Env, indices: Any, experts: int, factor: float) -> Reference:
    torch = env.torch
    tokens, top_k = indices.shape
    by_choice = indices.t().reshape(-1)  # j*T + t: first choices of every token, then second ones
    order = torch.argsort(by_choice, stable=True)
    counts = torch.bincount(by_choice, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device) - starts[by_choice[order]]
    capacity = capacity_for(tokens, experts, top_k, factor, int(counts.max()))
    loc = slot.view(top_k, tokens).t()  # (T, k)
    row_map = torch.where(loc < capacity, indices * capacity + loc, torch.full_like(loc, -1))
    flat = row_map.reshape(-1)
    kept = torch.nonzero(flat >= 0).squeeze(1)
    return Reference(capacity, row_map, kept, flat[kept], kept // top_k, order, counts)


class Config:
    """One (T, E, k, M, dtype, capacity factor): the shared inputs and the routing."""

    def __init__(self, env: Env, x: Any, indices: Any, gates: Any, experts: int, dtype: str, factor: float):
        self.env = env
        self.x = x
        self.indices = indices
        self.gates = gates
        self.tokens, self.model_dim = x.shape
        self.top_k = indices.shape[1]
        self.experts = experts
        self.dtype = dtype
        self.factor = factor
        self.ref = reference_routing(env, indices, experts, factor)
        self._routing: Any = None
        self._dispatched: Any = None
        self._sorted: Any = None

    @property
    def routing(self) -> Any:
        if self._routing is None:
            a2a = self.env.a2a
            self._routing = a2a.route(self.indices, self.experts, capacity_setting=self.factor)
        return self._routing

    @property
    def kept(self) -> int:
        return int(self.ref.kept_choices.numel())

    @property
    def routed(self) -> int:
        return self.tokens * self.top_k

    # -- torch index-op versions (the baselines and the reference results) --

    # Products with the gates are formed in the accumulator type (float32,
    # float64 for float64), as the kernels do, with as few temporaries as
    # torch allows: a mixed-dtype product would first copy its input to float32.

    def _gated(self, rows: Any, gates: Any, fresh: bool) -> Any:
        """rows * gates[:, None] in the accumulator type; rows may be overwritten when fresh."""
        acc_t = self.env.acc_dtype(self.dtype)
        if rows.dtype != acc_t:
            rows, fresh = rows.to(acc_t), True
        if gates is None:
            return rows
        g = gates.to(acc_t).unsqueeze(1)
        return rows.mul_(g) if fresh else rows * g

    def index_encode(self, x: Any, out: Any = None) -> Any:
        torch, ref = self.env.torch, self.ref
        shape = (self.experts * ref.capacity, self.model_dim)
        out = torch.zeros(shape, dtype=x.dtype, device=x.device) if out is None else out.view(shape).zero_()
        picked = x.index_select(0, ref.kept_tokens)
        if self.gates is not None:
            picked = self._gated(picked, self.gates.reshape(-1)[ref.kept_choices], fresh=True).to(x.dtype)
        out.index_copy_(0, ref.kept_rows, picked)
        return out.view(self.experts, ref.capacity, self.model_dim)

    def _weighted_sum(self, tokens: Any, rows: Any, gates: Any, fresh: bool, like: Any, out: Any) -> Any:
        """y[tokens[i]] += gates[i] * rows[i] in the accumulator type, then y in like's dtype (into out)."""
        torch = self.env.torch
        acc_t = self.env.acc_dtype(self.dtype)
        if out is not None and out.dtype == acc_t:
            acc = out.zero_()
        else:
            acc = torch.zeros((self.tokens, self.model_dim), dtype=acc_t, device=like.device)
        acc.index_add_(0, tokens, self._gated(rows, gates, fresh))
        if out is None:
            return acc.to(like.dtype)
        if acc is not out:
            out.copy_(acc)
        return out

    def index_decode(self, d: Any, out: Any = None) -> Any:
        ref = self.ref
        rows = d.reshape(-1, self.model_dim).index_select(0, ref.kept_rows)
        gates = None if self.gates is None else self.gates.reshape(-1)[ref.kept_choices]
        return self._weighted_sum(ref.kept_tokens, rows, gates, True, d, out)

    def index_permute(self, x: Any, out: Any = None) -> Any:
        torch = self.env.torch
        order = torch.argsort(self.indices.t().reshape(-1), stable=True)
        if out is None:
            return x.index_select(0, order % self.tokens)
        return torch.index_select(x, 0, order % self.tokens, out=out)

    def index_unpermute(self, y_sorted: Any, out: Any = None) -> Any:
        ref = self.ref
        gates = None if self.gates is None else self.gates.t().reshape(-1)[ref.order]
        return self._weighted_sum(ref.order % self.tokens, y_sorted, gates, False, y_sorted, out)

    # -- inputs of decode and unpermute (built once, with the reference) --

    def dispatched(self) -> Any:
        if self._dispatched is None:
            saved, self.gates = self.gates, None  # Tutel's is_postscore: gates applied once, at decode
            try:
                self._dispatched = self.index_encode(self.x)
            finally:
                self.gates = saved
        return self._dispatched

    def y_sorted(self) -> Any:
        if self._sorted is None:
            self._sorted = self.index_permute(self.x)
        return self._sorted

    def release(self) -> None:
        self._dispatched = None
        self._sorted = None

    # -- GShard's dense einsum --

    def dense_mask(self) -> Any:
        torch, ref = self.env.torch, self.ref
        mask = torch.zeros(
            (self.tokens, self.experts, ref.capacity), dtype=self.x.dtype, device=self.x.device
        )
        loc = ref.row_map.reshape(-1)[ref.kept_choices] % ref.capacity
        expert = self.indices.reshape(-1)[ref.kept_choices]
        weight = (
            self.gates.reshape(-1)[ref.kept_choices].to(self.x.dtype)
            if self.gates is not None
            else torch.ones(loc.shape, dtype=self.x.dtype, device=self.x.device)
        )
        mask[ref.kept_tokens, expert, loc] = weight
        return mask
