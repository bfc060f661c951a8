"""The dropless dispatcher (the Deployment paper's dynamic gating, Fig. 8b):
every routed choice reaches its expert, nothing is padded, nothing dropped.

One call, r = 1 (each rank holds n whole experts: E = n W), d = 1::

    tokens (T, M), indices (T, k)
    permute          -> x_sorted (N, M), rows grouped by expert; counts (E,)
    count exchange   -> per source rank, the rows of each of my n experts
                        (a2a.all_to_all of E int64 per rank)
    all_to_all_v     -> received (R, M): source-major, then expert-major
    permute by local expert -> (R, M) grouped by my experts
    FFN of each expert on its contiguous rows (no padding; ragged_ffn.py)
    unpermute        -> (R, M) in the received order
    all_to_all_v back (the received counts) -> (N, M) in x_sorted's order
    unpermute with the gates -> y (T, M)

Every step is a differentiable a2a.torch function (or a torch op), so
autograd runs the reverse flow. Only r = 1 with whole experts: with s > 1
ranks sharing an expert each row would go to every sharer (model
parallelism), which the padded flows already do; and d = 1, since the
chunks of the pipelined flows are slices of the padded capacity axis, which
this layout does not have.

With an expert cache (inference, Deployment paper Section VI) the count
exchange tells which local experts receive rows; those are fetched into the
cache's device slots before the data exchange (so the copies overlap it), or
one at a time when they outnumber the slots, and the FFN reads the slots.
The same ops on the same values: the output equals the uncached layer's
bitwise.
"""

from __future__ import annotations

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from .activation import Activation
from .expert_cache import ExpertCache
from .ragged_ffn import ExpertWeights, ffn_rows, ragged_ffn

__all__ = ["dropless_moe"]


def _expert_rows_per_source(counts: torch.Tensor, comm: a2a.Comm) -> np.ndarray:
    """(W, n): how many rows each source rank sends to each of my n experts.
    `counts` (E,) is this rank's rows per expert, on the tokens' device; E =
    n W, experts of rank j are [j n, (j + 1) n)."""
    received = a2a.all_to_all(counts.contiguous(), comm=comm)  # block j of rank i's counts goes to rank j
    return received.cpu().numpy().reshape(comm.size, -1)


def dropless_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None, *,
                 weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
                 activation: Activation, comm: a2a.Comm, algo: str, weight_grad_scale: float = 1.0,
                 expert_cache: ExpertCache | None = None) -> tuple[torch.Tensor, np.ndarray, int]:
    """y (T, M) of this rank's tokens, the rows each local expert computed
    (n,), and the rows this rank sent to other ranks (in each exchange).
    `weights`: this rank's (fc1 (n, H, M), fc1_bias (n, H) or None, fc2 (n,
    H, M), fc2_bias (n, M) or None); `gates` (T, k) weigh the expert outputs
    at the combine (None: weight 1). `expert_cache` (inference only: no
    gradients): the experts' weights come from its device slots instead, and
    only the experts that receive rows are fetched."""
    fc1 = weights[0]
    local = fc1.shape[0]
    num_experts = local * comm.size

    x_sorted, perm = a2a_torch.permute(tokens, indices, num_experts)
    per_source = _expert_rows_per_source(perm.counts, comm)  # (W, n)
    rows_per_expert = per_source.sum(axis=0)
    slots = None
    if expert_cache is not None and np.count_nonzero(rows_per_expert) <= expert_cache.num_slots:
        # Known from the count exchange: the copies (a stream of their own on
        # CUDA) overlap the exchange below.
        slots = expert_cache.fetch(np.flatnonzero(rows_per_expert).tolist())
    send_counts = perm.counts.view(comm.size, local).sum(dim=1).cpu().numpy()
    received, recv_counts = a2a_torch.all_to_all_v(x_sorted, send_counts, comm=comm, algo=algo)

    # Received rows are source-major; group them by local expert.
    expert_of_row = np.repeat(np.tile(np.arange(local, dtype=np.int64), comm.size), per_source.reshape(-1))
    expert_of_row = torch.from_numpy(expert_of_row).to(tokens.device).view(-1, 1)
    by_expert, local_perm = a2a_torch.permute(received, expert_of_row, local)
    offsets = local_perm.offsets.tolist()
    if expert_cache is None:
        computed = ragged_ffn(by_expert, offsets, *weights, activation, weight_grad_scale)
    else:
        computed = _cached_ffn(by_expert, offsets, rows_per_expert, expert_cache, slots, fc1.shape[1], activation)
    back = a2a_torch.unpermute(computed, local_perm)  # the received order again
    returned, _ = a2a_torch.all_to_all_v(back, recv_counts, comm=comm, algo=algo)
    y = a2a_torch.unpermute(returned, perm, gates)
    sent_to_others = int(send_counts.sum() - send_counts[comm.rank])
    return y, rows_per_expert, sent_to_others


def _cached_ffn(rows: torch.Tensor, offsets: list[int], rows_per_expert: np.ndarray, cache: ExpertCache,
                slots: dict[int, int] | None, hidden_size: int, activation: Activation) -> torch.Tensor:
    """The experts' FFN with weights from the cache's slots: all fetched
    already (`slots`), or, when the batch has more active experts than slots,
    one at a time as the paper runs them (fetch_each)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        raise RuntimeError("the expert cache serves inference only: run the layer under torch.no_grad()")
    pool = cache.pool

    def expert(slot: int) -> ExpertWeights:
        return (pool["fc1_w"][slot], pool["fc1_bias"][slot] if "fc1_bias" in pool else None,
                pool["fc2_w"][slot], pool["fc2_bias"][slot] if "fc2_bias" in pool else None)

    active = np.flatnonzero(rows_per_expert).tolist()
    placed = ((e, slots[e]) for e in active) if slots is not None else cache.fetch_each(active)
    out = rows.new_empty(rows.shape)
    hidden = rows.new_empty((rows.shape[0], hidden_size))
    ffn_rows(rows, offsets, ((e, expert(slot)) for e, slot in placed), activation, out, hidden)
    return out
