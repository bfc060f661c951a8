"""The dropless flow's exchange (the Deployment paper's dynamic gating, Fig. 8b):
every routed choice reaches its expert, nothing is padded, nothing dropped.

One call, r = 1 (each rank holds n whole experts: E = n W), d = 1::

    tokens (T, M), indices (T, k)
    permute          -> x_sorted (N, M), rows grouped by expert; counts (E,)
    count exchange   -> per source rank, the rows of each of my n experts
                        (the counts permute knew on the host, an all_to_all
                        of E int64 per rank over the layer's host twin: the
                        step's one wait for the device is permute's)
    all_to_all_v     -> received (R, M): source-major, then expert-major
                        (FP8 dispatch: the tokens quantized before permute,
                        their pairs exchanged, dequantized on arrival)
    permute by local expert -> (R, M) grouped by my experts (no wait: the
                        counts are known, and every row is routed)
    FFN of each expert on its contiguous rows (no padding; ragged_ffn.py)
    unpermute        -> (R, M) in the received order
    all_to_all_v back (the received counts) -> (N, M) in x_sorted's order
    unpermute with the gates -> y (T, M)

On one rank (W = 1) the rows are their own: the counts are read without an
exchange, and the permuted rows are the experts' input as they are (no
exchange, no local permutation: from one source they are grouped by expert
already), so the flow is permute, FFN, unpermute. With ``wait=False`` (one
rank only) not even the counts are read: a2a.permute(..., wait=False) gives
T*k rows and the offsets on the device, which the grouped GEMMs take as they
are (experts/grouped.py), so the step reads nothing back.

Every step is a differentiable a2a.torch function (or a torch op), so
autograd runs the reverse flow. Only r = 1 with whole experts: with s > 1
ranks sharing an expert each row would go to every sharer (model
parallelism), which the padded flows already do; and d = 1, since the
chunks of the pipelined flows are slices of the padded capacity axis, which
this layout does not have.

Two steps, :func:`dispatch` (up to ``received``) and
:func:`experts_and_return` (the rest), so that the sample-assignment cache
(moe_runtime.deployment.cached_dispatch) can make the same ``received`` another way.

With an expert cache (inference, Deployment paper Section VI) the count
exchange tells which local experts receive rows; those are fetched into the
cache's device slots before the data exchange (so the copies overlap it), or
one at a time when they outnumber the slots, and the FFN reads the slots:
the loop over the experts, the uncached layer's where it runs no grouped
GEMMs (experts/grouped.py), so the output equals the uncached layer's
bitwise there and to rounding elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from ..common.host_values import all_to_all_values, uploaded
from ..common.precision import FP8_BLOCK
from ..experts.activation import Activation
from ..experts.ragged_ffn import ExpertWeights, ffn_rows, ragged_ffn
from .expert_cache import ExpertCache

__all__ = ["CACHED_WEIGHT_NAMES", "Dispatched", "dispatch", "dropless_moe", "experts_and_return", "rows_per_rank"]

# The expert cache's names of a local expert's (fc1, fc1_bias, fc2, fc2_bias); biases may be absent.
CACHED_WEIGHT_NAMES = ("fc1_w", "fc1_bias", "fc2_w", "fc2_bias")


def rows_per_rank(counts: torch.Tensor | np.ndarray, ranks: int) -> np.ndarray:
    """(W,) rows for each destination rank from a permutation's (E,) rows per
    expert (rank j holds experts [j n, (j + 1) n))."""
    counts = counts.cpu().numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts)
    return counts.reshape(ranks, -1).sum(axis=1)


def _fetch_if_they_fit(cache: ExpertCache, rows_per_expert: np.ndarray) -> dict[int, int] | None:
    """{expert: slot} with every expert that has rows made resident at once,
    or None (nothing fetched) when they outnumber the cache's slots."""
    active = np.flatnonzero(rows_per_expert)
    return cache.fetch(active.tolist()) if active.size <= cache.num_slots else None


def _count_exchange(perm: a2a.Routing, comm: a2a.Comm, count_comm: a2a.Comm) -> tuple[np.ndarray, np.ndarray]:
    """((W,) rows this rank sends to each rank, (W, n) rows each source rank
    sends to each of my n experts). This rank's rows per expert are the
    permutation's counts, known on the host since permute waited for them;
    the other ranks' come over `count_comm` (the layer's host twin: no wait
    for a device). E = n W, experts of rank j are [j n, (j + 1) n)."""
    counts = perm.host_counts
    received = all_to_all_values(counts, count_comm)  # block j of rank i's counts goes to rank j (one rank: mine)
    return rows_per_rank(counts, comm.size), received.reshape(comm.size, -1)


@dataclass
class Dispatched:
    """The dispatch's result on one rank, what the experts and the way back need.

    ``received`` (R, M): the rows for my experts, source-major, then expert
    by expert, each expert's rows in the source's slot order (a2a.permute's:
    first choices before second ones). ``per_source`` (W, n) int64: rows from
    each source rank for each of my n experts (R = its sum). ``perm``: the
    permutation of this rank's choices (a2a.permute's Routing); ``send_counts``
    (W,) int64: rows this rank sent to each rank. ``slots``: {expert: slot}
    of the expert cache when the dispatch fetched the experts already. On one
    rank without a wait (``dispatch(wait=False)``) per_source and send_counts
    are None: the counts stay on the device, in perm."""

    received: torch.Tensor
    per_source: np.ndarray | None
    perm: a2a.Routing
    send_counts: np.ndarray | None
    slots: dict[int, int] | None = None


def dispatch(tokens: torch.Tensor, indices: torch.Tensor, num_experts: int, *, comm: a2a.Comm,
             algo: str, expert_cache: ExpertCache | None = None, fp8: str | None = None,
             count_comm: a2a.Comm | None = None, wait: bool = True) -> Dispatched:
    """permute, the count exchange and all_to_all_v (autograd through a2a.torch).
    With `expert_cache`, the experts receiving rows are fetched between the
    count exchange and the data exchange when they fit the slots at once.
    `fp8` (a2a's format): the tokens are quantized once and their FP8 rows
    permuted and exchanged (_Fp8Arrival), dequantized on arrival.
    `count_comm`: where the counts (host values) are exchanged (default
    `comm`; the layer passes its host twin). `wait` False (one rank, no
    cache, no FP8: the flow checks): nothing is read back."""
    if not wait:
        received, perm = a2a_torch.permute(tokens, indices, num_experts, wait=False)
        return Dispatched(received, None, perm, None)
    if fp8 is None:
        x_sorted, perm = a2a_torch.permute(tokens, indices, num_experts)
    else:
        x_sorted, perm = a2a.permute(a2a.quantize_fp8(tokens.detach(), FP8_BLOCK, format=fp8), indices, num_experts)
    send_counts, per_source = _count_exchange(perm, comm, count_comm or comm)  # (W,), (W, n)
    # On CUDA the cache copies on a stream of its own: they overlap the exchange.
    slots = None if expert_cache is None else _fetch_if_they_fit(expert_cache, per_source.sum(axis=0))
    if fp8 is None and comm.size == 1:
        received = x_sorted  # one rank's rows are its own: no exchange, no copy
    elif fp8 is None:
        received, _ = a2a_torch.all_to_all_v(x_sorted, send_counts, comm=comm, algo=algo)
    else:
        received = _Fp8Arrival.apply(tokens, x_sorted, perm, send_counts, per_source.sum(axis=1), comm, algo)
    return Dispatched(received, per_source, perm, send_counts, slots)


class _Fp8Arrival(torch.autograd.Function):
    """The permuted FP8 pair exchanged (one all_to_all_v: codes and scales
    together) and dequantized to the tokens' dtype; the backward brings the
    gradient back in its own dtype (all_to_all_v of the received counts) and
    sums each token's rows (unpermute without gates): the adjoint of permute
    and exchange, the quantization passing the gradient straight through."""

    @staticmethod
    def forward(ctx, tokens, pair, perm, send_counts, received_counts, comm, algo):
        ctx.perm, ctx.received_counts, ctx.comm, ctx.algo = perm, received_counts, comm, algo
        arrived, _ = a2a.all_to_all_v(pair, send_counts, comm=comm, algo=algo)
        return a2a.dequantize_fp8(*arrived, block=FP8_BLOCK, dtype=str(tokens.dtype).removeprefix("torch."))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_received):
        back, _ = a2a.all_to_all_v(grad_received.contiguous(), ctx.received_counts, comm=ctx.comm, algo=ctx.algo)
        return a2a.unpermute(back, ctx.perm), None, None, None, None, None, None


def experts_and_return(dispatched: Dispatched, gates: torch.Tensor | None, *,
                       weights: ExpertWeights, activation: Activation, comm: a2a.Comm, algo: str,
                       weight_grad_scale: float = 1.0, expert_cache: ExpertCache | None = None) -> torch.Tensor:
    """Each local expert's FFN on its rows of ``dispatched.received``, the
    rows back to their ranks and the gate-weighted combine: y (T, M).
    `weights`: this rank's (fc1 (n, H, M), fc1_bias (n, H) or None, fc2 (n,
    H, M), fc2_bias (n, M) or None); `gates` (T, k) weigh the expert outputs
    at the combine (None: weight 1). `expert_cache` (inference only: no
    gradients): the experts' weights come from its device slots instead."""
    local = weights[0].shape[0]
    received, per_source = dispatched.received, dispatched.per_source
    # Received rows are source-major; group them by local expert. From one source (W = 1) they are grouped
    # already: the local permutation would be the identity.
    one_source = comm.size == 1
    by_expert, local_perm = received, None
    if not one_source:
        expert_of_row = np.repeat(np.tile(np.arange(local, dtype=np.int64), comm.size), per_source.reshape(-1))
        expert_of_row = uploaded(torch.from_numpy(expert_of_row), received.device).view(-1, 1)
        # Every row routed, its expert's counts known here: the layout needs no wait (N = R rows).
        by_expert, local_perm = a2a_torch.permute(received, expert_of_row, local, wait=False)
    # The local permutation's offsets, known on the host already (no read of its tables); without a wait
    # (one source), the permutation's own, on the device.
    offsets = dispatched.perm.offsets if per_source is None else [0, *np.cumsum(per_source.sum(axis=0)).tolist()]
    if expert_cache is None:
        computed = ragged_ffn(by_expert, offsets, *weights, activation, weight_grad_scale)
    else:
        computed = _cached_ffn(by_expert, offsets, per_source.sum(axis=0), expert_cache, dispatched.slots,
                               weights[0].shape[1], activation)
    if one_source:
        return a2a_torch.unpermute(computed, dispatched.perm, gates)
    back = a2a_torch.unpermute(computed, local_perm)  # the received order again
    returned, _ = a2a_torch.all_to_all_v(back, per_source.sum(axis=1), comm=comm, algo=algo)
    return a2a_torch.unpermute(returned, dispatched.perm, gates)


def _cached_ffn(rows: torch.Tensor, offsets: list[int], rows_per_expert: np.ndarray, cache: ExpertCache,
                slots: dict[int, int] | None, hidden_size: int, activation: Activation) -> torch.Tensor:
    """The experts' FFN with weights from the cache's slots: fetched already
    (`slots`), fetched now when they fit the slots at once, or else one at a
    time as the paper runs them (fetch_each)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        raise RuntimeError("the expert cache serves inference only: run the layer under torch.no_grad()")
    pool = cache.pool

    def expert(slot: int) -> ExpertWeights:
        fc1, fc1_bias, fc2, fc2_bias = (pool[name][slot] if name in pool else None for name in CACHED_WEIGHT_NAMES)
        return fc1, fc1_bias, fc2, fc2_bias

    if slots is None:
        slots = _fetch_if_they_fit(cache, rows_per_expert)
    active = np.flatnonzero(rows_per_expert).tolist()
    placed = ((e, slots[e]) for e in active) if slots is not None else cache.fetch_each(active)
    out = rows.new_empty(rows.shape)
    hidden = rows.new_empty((rows.shape[0], hidden_size))
    ffn_rows(rows, offsets, ((e, expert(slot)) for e, slot in placed), activation, out, hidden)
    return out


def dropless_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None, *,
                 weights: ExpertWeights, activation: Activation, comm: a2a.Comm, algo: str,
                 weight_grad_scale: float = 1.0, dispatched: Dispatched | None = None,
                 expert_cache: ExpertCache | None = None, fp8: str | None = None,
                 count_comm: a2a.Comm | None = None, wait: bool = True) -> tuple[torch.Tensor, np.ndarray | None, int]:
    """y (T, M) of this rank's tokens, the rows each local expert computed
    (n,; None without a wait: they stay on the device), and the rows this
    rank sent to other ranks (in each exchange). `wait`: see :func:`dispatch`.
    ``dispatched``: the dispatch of (tokens, indices) made already (by the
    sample-assignment cache, moe_runtime.deployment.cached_dispatch); else it is made
    here. `fp8` and `count_comm`: see :func:`dispatch`. For the other
    arguments see :func:`experts_and_return`."""
    if dispatched is None:
        dispatched = dispatch(tokens, indices, weights[0].shape[0] * comm.size, comm=comm, algo=algo,
                              expert_cache=expert_cache, fp8=fp8, count_comm=count_comm, wait=wait)
    y = experts_and_return(dispatched, gates, weights=weights, activation=activation, comm=comm, algo=algo,
                           weight_grad_scale=weight_grad_scale, expert_cache=expert_cache)
    if dispatched.per_source is None:
        return y, None, 0  # one rank: nothing sent to others
    send_counts = dispatched.send_counts
    sent_to_others = int(send_counts.sum() - send_counts[comm.rank])
    return y, dispatched.per_source.sum(axis=0), sent_to_others

