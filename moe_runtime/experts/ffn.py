"""Expert parameters in one layout for every r: what makes switching r free.

Tutel's FFN experts (``experts={"type": "ffn", ...}``): expert e computes
``act(x @ fc1_w[e]^T + fc1_bias[e]) @ fc2_w[e] + fc2_bias[e]`` with fc1_w and
fc2_w of shape (H, M).

W ranks, E experts, ``num_experts_per_device`` n:

- n > 0: E = n * W; rank i holds experts [i*n, (i+1)*n) whole (s = 1);
- n = -s < 0: E = W / s; the s consecutive ranks i = e*s + j share expert e,
  rank i holding hidden units [j*H/s, (j+1)*H/s) of fc1_w, fc2_w, fc1_bias,
  and columns [j*Ms, (j+1)*Ms) of fc2_bias (Ms = ceil(M/s), zero-padded).

Stored per rank (Tutel's names)::

    batched_fc1_w     (n_l, H/s, M)      n_l = n, or 1 when shared
    batched_fc2_w     (n_l, H/s, M)
    batched_fc1_bias  (n_l, H/s)         if has_fc1_bias
    batched_fc2_bias  (n_l, Ms)          if has_fc2_bias (Ms = M when s = 1)

Each flow gathers what it needs from this layout by an all-gather whose
backward is a reduce-scatter (so gradients land on the shards): r = 0 the
whole (E, H, M) from every rank; r >= 1 with group size g = s / r > 1 the
group's H/r slice; nothing for g = 1. The fc2 bias travels with them and is
added at the expert when r <= 1 (its output is whole there); for r > 1 the
experts' outputs are partial sums, so it is gathered whole, (E, M), and
added once where the rows come back.

The dictionary's other flows (the layer's ``flows=``) run on this layout
too, with whole experts (s = 1): dropless reads the local experts as they
are; Hexa-MoE's data-centric flow all-gathers the (n, H, M) shards into the
whole (E, H, M) (already in expert order) in the pipeline-shared cache and
reduce-scatters the whole gradients back (``gather_whole``,
``reduce_scatter_whole``); its model-centric flow takes rank w's hidden
slice (E, H_w, M) of every expert by an all-to-all (``hidden_slices``:
rank i sends rows [o_w, o_w + H_w) of its n experts to rank w, who stacks
them in rank order; H_w uniform, larger on the lower ranks when W does not
divide H), whose backward sends the slices' gradients back. Both take the
fc2 bias whole by an all-gather (``fc2_bias``).

Every expert is initialized from its own generator, seeded by
(expert_seed, e), as nn.Linear would (uniform in +-1/sqrt(fan_in)), so the
model is the same whatever W and s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import a2a
import a2a.torch as a2a_torch

from ..common.buffers import Lease
from ..common.initialization import uniform
from .split import offsets, uniform_split

__all__ = ["FFNExperts", "check_ffn_spec", "draw_expert", "expert_layout"]

_EXPERT_KEYS = {"type", "num_experts_per_device", "count_per_node", "hidden_size_per_expert", "activation_fn",
                "has_fc1_bias", "has_fc2_bias"}
WEIGHT_NAMES = ("batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias")  # Tutel's, in this order
EXPERT_TAG = "_moe_expert"  # set on expert parameters: their gradients are not all-reduced


def expert_layout(spec: dict[str, Any], world_size: int) -> tuple[int, int, int]:
    """(E, s, n_l) of an experts dictionary on `world_size` ranks."""
    n = spec.get("num_experts_per_device", spec.get("count_per_node", 1))
    if not isinstance(n, int) or isinstance(n, bool) or n == 0:
        raise ValueError(f"experts: num_experts_per_device must be a non-zero integer, got {n!r}")
    if n > 0:
        return n * world_size, 1, n
    share = -n
    if world_size % share != 0:
        raise ValueError(
            f"experts: num_experts_per_device={n} means {share} ranks share each expert, but the world size "
            f"{world_size} is not a multiple of {share}"
        )
    return world_size // share, share, 1


def check_ffn_spec(spec: dict[str, Any]) -> int:
    """The hidden size H of an experts dictionary, after checking its keys and values."""
    if not isinstance(spec, dict):
        raise TypeError(f"experts must be a dict such as {{'type': 'ffn', ...}}, got {type(spec).__name__}")
    unknown = set(spec) - _EXPERT_KEYS
    if unknown:
        raise ValueError(f"experts: unknown keys {sorted(unknown)}; known: {sorted(_EXPERT_KEYS)}")
    if spec.get("type", "ffn") != "ffn":
        raise ValueError(f"experts: only type 'ffn' is supported, got {spec.get('type')!r}")
    hidden = spec.get("hidden_size_per_expert")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise ValueError(f"experts: hidden_size_per_expert must be a positive integer, got {hidden!r}")
    return hidden


def draw_expert(expert_seed: int, expert: int, hidden: int, model_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert `expert` whole, in float64: (fc1_w (H, M), fc1_bias (H,), fc2_w
    (H, M), fc2_bias (M,)), from its own generator, as nn.Linear would draw
    them; every layout of the experts keeps its part of these."""
    generator = torch.Generator().manual_seed(expert_seed * 1_000_003 + expert)
    fc1 = uniform((hidden, model_dim), 1.0 / math.sqrt(model_dim), generator)
    fc2 = uniform((hidden, model_dim), 1.0 / math.sqrt(hidden), generator)
    fc1_bias = uniform((hidden,), 1.0 / math.sqrt(model_dim), generator)
    fc2_bias = uniform((model_dim,), 1.0 / math.sqrt(hidden), generator)
    return fc1, fc1_bias, fc2, fc2_bias


class FFNExperts(torch.nn.Module):
    """This rank's shards of the experts (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], model_dim: int, comm: a2a.Comm, expert_seed: int,
                 slots: Sequence[int] | None = None):
        """`slots`: the experts this rank's slots hold, for FlexMoE's vExpert
        slots (moe_runtime.flex.vexperts; -1: a free slot, zeros); None: the
        layout above."""
        super().__init__()
        hidden = check_ffn_spec(spec)
        self.num_experts, self.sharers, self.num_local = expert_layout(spec, comm.size)
        self.rank, self.world_size = comm.rank, comm.size
        if slots is not None:
            if self.sharers > 1:
                raise ValueError("experts: vExpert slots hold whole experts; num_experts_per_device must be > 0")
            self.num_local = len(slots)
        self.slot_experts = list(slots) if slots is not None else \
            [self.first_expert + local for local in range(self.num_local)]
        if hidden % self.sharers != 0:
            raise ValueError(
                f"experts: hidden_size_per_expert={hidden} must be a multiple of the {self.sharers} ranks "
                "that share an expert"
            )
        self.model_dim, self.hidden_size = model_dim, hidden
        self.activation_fn: Callable[[torch.Tensor], torch.Tensor] = spec.get("activation_fn") or F.relu
        shard = hidden // self.sharers
        self.bias_shard = -(-model_dim // self.sharers)
        self.batched_fc1_w = torch.nn.Parameter(torch.empty(self.num_local, shard, model_dim))
        self.batched_fc2_w = torch.nn.Parameter(torch.empty(self.num_local, shard, model_dim))
        self.batched_fc1_bias = (
            torch.nn.Parameter(torch.empty(self.num_local, shard)) if spec.get("has_fc1_bias", True) else None
        )
        self.batched_fc2_bias = (
            torch.nn.Parameter(torch.empty(self.num_local, self.bias_shard)) if spec.get("has_fc2_bias", True) else None
        )
        for parameter in self.parameters():
            setattr(parameter, EXPERT_TAG, True)
        self.reset_parameters(expert_seed)

    @property
    def first_expert(self) -> int:
        """The (first) expert this rank holds."""
        return self.rank // self.sharers if self.sharers > 1 else self.rank * self.num_local

    @property
    def shard_index(self) -> int:
        """j: which 1/s of the hidden units this rank holds (0 when s = 1)."""
        return self.rank % self.sharers

    def reset_parameters(self, expert_seed: int) -> None:
        """Draws every local expert whole from its own generator and keeps this
        rank's shard (a free vExpert slot: zeros)."""
        m, h, s, j = self.model_dim, self.hidden_size, self.sharers, self.shard_index
        rows = slice(j * h // s, (j + 1) * h // s)
        cols = slice(j * self.bias_shard, min((j + 1) * self.bias_shard, m))
        with torch.no_grad():
            for local, expert in enumerate(self.slot_experts):
                if expert < 0:
                    for parameter in self.parameters():
                        parameter[local].zero_()
                    continue
                fc1, fc1_bias, fc2, fc2_bias = draw_expert(expert_seed, expert, h, m)
                self.batched_fc1_w[local].copy_(fc1[rows])
                self.batched_fc2_w[local].copy_(fc2[rows])
                if self.batched_fc1_bias is not None:
                    self.batched_fc1_bias[local].copy_(fc1_bias[rows])
                if self.batched_fc2_bias is not None:
                    self.batched_fc2_bias[local].zero_()
                    self.batched_fc2_bias[local, : cols.stop - cols.start].copy_(fc2_bias[cols])

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """This rank's (fc1_w, fc1_bias or None, fc2_w, fc2_bias or None), as stored."""
        fc1, fc1_bias, fc2, fc2_bias = (getattr(self, name) for name in WEIGHT_NAMES)
        return fc1, fc1_bias, fc2, fc2_bias

    # -- what the dictionary's other flows gather (moe_runtime.hexa.flows, hexa_cache) ----------
    def sharded_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's (fc1_w, fc1_bias or None, fc2_w), as stored: the
        tensors the Hexa-MoE flows gather or slice along H."""
        self._require_whole_experts()
        return self.batched_fc1_w, self.batched_fc1_bias, self.batched_fc2_w

    def gather_whole(self, shard: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` (E, H, ...) <- every rank's `shard` (n, H, ...) (collective
        over the world, no autograd): rank i's experts are [i n, (i+1) n)."""
        self._require_whole_experts()
        return a2a.all_gather(shard, comm=comm, out=out)

    def reduce_scatter_whole(self, whole: torch.Tensor, comm: a2a.Comm, out: torch.Tensor) -> torch.Tensor:
        """`out` (n, H, ...) <- this rank's experts' rows of the sum over ranks of `whole` (E, H, ...)."""
        self._require_whole_experts()
        return a2a.reduce_scatter(whole, comm=comm, out=out)

    def hidden_slices(self, comm: a2a.Comm) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Rank w's hidden slice of every expert, (fc1_w (E, H_w, M), fc1_bias
        (E, H_w) or None, fc2_w (E, H_w, M)), exchanged with autograd (the
        backward returns the slices' gradients to the shards). Collective."""
        split = uniform_split(self.hidden_size, comm.size)
        return tuple(None if shard is None else _exchange_hidden(shard, split, comm)
                     for shard in self.sharded_weights())

    def _require_whole_experts(self) -> None:
        if self.sharers > 1 or self.slot_experts != [self.first_expert + i for i in range(self.num_local)]:
            raise ValueError("experts: gathering every expert whole in expert order needs whole experts in Tutel's "
                             "layout (num_experts_per_device > 0, no vExpert slots)")

    def gathered(self, comm: a2a.Comm | None, shards: dict[str, torch.Tensor] | None = None,
                 lease: Lease | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(fc1_w, fc1_bias, fc2_w, fc2_bias) of the experts a flow computes
        here, gathered over `comm` (None: this rank's shard alone): the world
        for r = 0, (E, H, M) and (E, M); a group of g ranks sharing an expert,
        (1, g*H/s, M). fc2_bias (n, M) only where the ranks gathered hold all
        its columns (s = 1, the world, or all s sharers: g = s), else None.
        `shards` replaces the parameters (by name) with same-shaped tensors.
        `lease`: the gathered tensors go into its buffers (a training step's:
        r = 0 gathers every expert, 64 MiB at E = 8, H = M = 1024, which
        allocated fresh each step costs page faults on every step)."""
        shards = shards or {}
        names = WEIGHT_NAMES
        fc1, fc1_bias, fc2, fc2_bias = (shards.get(name, getattr(self, name)) for name in names)
        size = 1 if comm is None else comm.size
        experts = max(self.num_local * size // self.sharers, 1)

        def gather(name: str, p: torch.Tensor | None) -> torch.Tensor | None:
            if p is None:
                return None
            if size == 1:
                whole = p
            else:
                out = None if lease is None else lease.get(name, (size * p.shape[0], *p.shape[1:]), p.dtype, p.device)
                whole = a2a_torch.all_gather(p, comm=comm, out=out)
            return whole if whole.shape[0] == experts else whole.reshape(experts, -1, *p.shape[2:])

        whole_bias = self.sharers == 1 or size % self.sharers == 0  # the ranks gathered hold every column
        bias = gather(names[3], fc2_bias) if whole_bias else None
        return (gather(names[0], fc1), gather(names[1], fc1_bias), gather(names[2], fc2),
                None if bias is None else bias[:, : self.model_dim])

    def fc2_bias(self, comm: a2a.Comm) -> torch.Tensor | None:
        """The whole fc2 bias, (E, M), gathered from every rank of `comm` (the world)."""
        if self.batched_fc2_bias is None:
            return None
        whole = self.batched_fc2_bias if comm.size == 1 else a2a_torch.all_gather(self.batched_fc2_bias, comm=comm)
        return whole.reshape(self.num_experts, -1)[:, : self.model_dim]

    def gather_experts(self, comm: a2a.Comm, *, grad: bool = False) -> dict[str, torch.Tensor]:
        """Every expert whole, on every rank (no autograd); their gradients
        with grad=True (zeros where a parameter has none)."""
        shards = {}
        if grad:
            shards = {name: p.grad if p.grad is not None else torch.zeros_like(p)
                      for name, p in self.named_parameters()}
        with torch.no_grad():
            fc1, fc1_bias, fc2, fc2_bias = self.gathered(comm, shards)
            full = {"batched_fc1_w": fc1, "batched_fc2_w": fc2}
            if fc1_bias is not None:
                full["batched_fc1_bias"] = fc1_bias
            if fc2_bias is not None:
                full["batched_fc2_bias"] = fc2_bias
        return {name: tensor.detach().contiguous().clone() for name, tensor in full.items()}

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, sharers={self.sharers}, local={self.num_local}, "
            f"model_dim={self.model_dim}, hidden_size={self.hidden_size}"
        )


def _exchange_hidden(shard: torch.Tensor, split: Sequence[int], comm: a2a.Comm) -> torch.Tensor:
    """(E, H_w, ...) on rank w from every rank's (n, H, ...): rank i sends
    hidden rows [o_w, o_w + H_w) of its n experts to rank w, who stacks them
    in rank order (the experts' order). Autograd: the reverse exchange."""
    rank = comm.rank
    if len(set(split)) == 1:  # H_w = H / W: the layout change travels in the all-to-all itself
        return a2a_torch.all_to_all_flex(shard, comm=comm, split_axis=1, concat_axis=0)
    starts, tail = offsets(split), shard.shape[2:]
    pieces = [shard[:, starts[w]: starts[w + 1]].reshape(-1, *tail) for w in range(comm.size)]
    counts = [shard.shape[0] * hidden for hidden in split]
    received, _ = a2a_torch.all_to_all_v(torch.cat(pieces), counts, comm=comm)
    return received.view(comm.size * shard.shape[0], split[rank], *tail)
