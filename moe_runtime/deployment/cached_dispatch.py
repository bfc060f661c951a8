"""The dropless dispatch by a predicted assignment, corrected to the actual one
(sample-assignment caching, DynaMoE Section 4.2; the cache and its policy
are in moe_runtime.deployment.assignment_cache).

One call with caching on, on every rank (W ranks, n experts each, E = n W)::

    before the gate   predicted (T, k) from the cache (-1: no prediction)
      comm thread:    permute(tokens, predicted) -> all_to_all_v   (no count exchange)
                      -> pool_p: rows at their predicted experts' ranks
      caller:         the gate -> actual indices (T, k), gates
    join
    hit (t, j): actual[t, j] in predicted[t, :]
    correction        permute(tokens, actual where not hit)  -> all_to_all_v -> pool_c
    plan              to each rank r: the counts of r's n experts, then for
                      each of my rows to r in the uncached order its place:
                      p >= 0 (row p of my block in pool_p) or -1 - c (row c
                      of my block in pool_c); one int64 all_to_all_v
    received = cat(pool_p, pool_c)[place]

``received`` holds the rows of the uncached dispatch (moe_runtime.deployment.dropless)
in its order, bit for bit (rows are copied, never computed), so the experts
and the way back, the same code, give the same output. Its backward is the
uncached dispatch's (the gradient rows go back by one all_to_all_v of the
received counts and sum per token by the actual permutation), so every
gradient is the same too. Predicted rows that no choice uses are dropped.

A recomputation of a call (activation checkpointing: moe_runtime.common.recompute)
dispatches by its forward's decision and prediction, kept under the call's
sample ids, with no agreement, and the cache learns nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import a2a

from ..common.agreement import CallFields
from ..common.overlap import Overlap
from ..common.recompute import recomputing
from .assignment_cache import AssignmentCache, AssignmentStats, check_sample_ids, predicted_choices
from .dropless import Dispatched, rows_per_rank

__all__ = ["CachedDispatch"]


def _first_rows(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: the first row of each block of `counts` rows."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class _ReceivedByPrediction(torch.autograd.Function):
    """received = pool[place], whose backward is the uncached dispatch's:
    all_to_all_v of the gradient rows with the received counts, then their
    sum per token by the actual permutation (a2a.unpermute without gates,
    the same kernel as a2a.permute's backward)."""

    @staticmethod
    def forward(ctx, tokens, pool, place, perm, recv_counts, comm, algo):
        ctx.perm, ctx.recv_counts, ctx.comm, ctx.algo = perm, recv_counts, comm, algo
        return pool.index_select(0, place)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        back, _ = a2a.all_to_all_v(grad.contiguous(), ctx.recv_counts, comm=ctx.comm, algo=ctx.algo)
        return a2a.unpermute(back, ctx.perm), None, None, None, None, None, None


class CachedDispatch:
    """One call's sample-assignment caching on one rank: made by :meth:`begin`
    before the gate, :meth:`join`-ed after it (before any other collective),
    :meth:`finish`-ed with the gate's indices."""

    def __init__(self, cache: AssignmentCache, sample_ids: np.ndarray, predicted: np.ndarray, num_experts: int,
                 comm: a2a.Comm, algo: str, wait: Callable[[], Any] | None, recomputed: bool = False):
        self.cache, self.sample_ids, self.predicted = cache, sample_ids, predicted
        self.recomputed = recomputed  # a recomputation (activation checkpointing): the cache learns nothing
        self.num_experts, self.comm, self.algo = num_experts, comm, algo
        self._wait, self._sent = wait, None
        self.stats: AssignmentStats | None = None

    @classmethod
    def begin(cls, cache: AssignmentCache, sample_ids: Any, tokens: torch.Tensor, top_k: int, num_experts: int, *,
              agree_comm: a2a.Comm, comm: a2a.Comm, overlap: Overlap, algo: str,
              call: CallFields | None = None) -> CachedDispatch | None:
        """Collective (on `agree_comm`): checks the ids, agrees on caching
        and, when it is on, starts the predicted dispatch on `overlap`'s
        thread over `comm`. None when no rank passed sample ids. `call`: the
        tokens' fields, agreed first (their model dim sizes the dispatch)."""
        ids, error = None, None
        if sample_ids is not None:
            try:
                ids = check_sample_ids(sample_ids, tokens.shape[0], agree_comm.rank)
            except (TypeError, ValueError) as bad:
                error = bad  # raised in the agreement, so that the other ranks raise too
        recomputed = recomputing()  # every rank recomputes: the forward's decision and prediction, no agreement
        if not recomputed:
            cached = cache.agree(agree_comm, ids is not None, error, call)
        if ids is None:
            return None
        key = (ids[0].tobytes(), ids[1], top_k)
        if recomputed:
            cached, predicted = cache.kept.take(key) or (False, cache.lookup(*ids, top_k))
            predicted = predicted.astype(np.int64)
        else:
            predicted = cache.lookup(*ids, top_k)
            if not torch.is_inference_mode_enabled():  # no recomputation there; kept small (experts < 2^31)
                cache.kept.keep(key, (cached, predicted.astype(np.int32)))
        sample_ids = ids[0]
        wait = None
        if cached:
            rows = tokens.detach()
            indices = torch.from_numpy(predicted).to(tokens.device)

            def send() -> tuple:
                x_sorted, perm = a2a.permute(rows, indices, num_experts)
                send_counts = rows_per_rank(perm.host_counts, comm.size)  # known on the host: no read
                received, recv_counts = a2a.all_to_all_v(x_sorted, send_counts, comm=comm, algo=algo)
                return perm, send_counts, received, recv_counts

            wait = overlap.start(send)
        return cls(cache, sample_ids, predicted, num_experts, comm, algo, wait, recomputed)

    def join(self) -> None:
        """Waits for the predicted dispatch (raises its error)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._sent = wait()

    def finish(self, tokens: torch.Tensor, indices: torch.Tensor) -> Dispatched | None:
        """The dispatch of the actual choices `indices` (T, k) when the
        prediction was dispatched (collective), else None (dispatch uncached);
        either way the cache learns the actual assignment, and ``stats`` is set."""
        self.join()
        actual = indices.detach().cpu().numpy().astype(np.int64, copy=False)
        hit, column = predicted_choices(actual, self.predicted)
        routed = actual >= 0
        hits, choices = int(hit.sum()), int(routed.sum())
        seen = (self.predicted >= 0).any(axis=1)  # tokens of samples the cache knew
        dispatched, corrected, unused = None, 0, 0
        if self._sent is not None:
            dispatched, corrected = self._correct(tokens, indices, actual, hit, column)
            unused = int((self.predicted >= 0).sum()) - hits
        if not self.recomputed:
            self.cache.observe(hits, int(routed[seen].sum()))  # unseen samples say nothing of convergence
            self.cache.store(self.sample_ids, actual)
        self.stats = AssignmentStats(hits, choices - hits, self.cache.score, dispatched is not None, corrected, unused)
        return dispatched

    def _correct(self, tokens, indices, actual, hit, column) -> tuple[Dispatched, int]:
        comm, algo, num_experts = self.comm, self.algo, self.num_experts
        ranks, local = comm.size, num_experts // comm.size
        predicted_perm, predicted_send, pool_p, predicted_recv = self._sent
        # The actual choices' permutation (only its routing: a one-column stand-in is permuted).
        _, perm = a2a.permute(tokens.detach().new_zeros((tokens.shape[0], 1)), indices.detach(), num_experts)
        missed = torch.from_numpy(np.where(hit, -1, actual)).to(tokens.device)
        correction, correction_perm = a2a.permute(tokens.detach(), missed, num_experts)
        counts = perm.host_counts  # known on the host since permute waited: no read of the device
        send = rows_per_rank(counts, ranks)
        correction_send = rows_per_rank(correction_perm.host_counts, ranks)

        # Each routed choice's place in its destination's block of pool_p or pool_c.
        routed = actual >= 0
        dest = np.where(routed, actual, 0) // local
        predicted_row = np.take_along_axis(predicted_perm.row_map.cpu().numpy(), column, axis=1)
        correction_row = correction_perm.row_map.cpu().numpy()
        place = np.where(hit, predicted_row - _first_rows(predicted_send)[dest],
                         -1 - (correction_row - _first_rows(correction_send)[dest]))
        in_order = np.empty(int(send.sum()), dtype=np.int64)  # the uncached order: x_sorted's
        in_order[perm.row_map.cpu().numpy()[routed]] = place[routed]
        first = _first_rows(send)
        message = np.concatenate([part for r in range(ranks) for part in
                                  (counts[r * local : (r + 1) * local], in_order[first[r] : first[r] + send[r]])])
        plan, plan_counts = a2a.all_to_all_v(torch.from_numpy(message).to(tokens.device), send + local, comm=comm,
                                             algo=algo)
        pool_c, correction_recv = a2a.all_to_all_v(correction, correction_send, comm=comm, algo=algo)

        plan = plan.cpu().numpy()
        starts = _first_rows(plan_counts)
        per_source = np.stack([plan[s : s + local] for s in starts])
        places = np.concatenate([plan[s + local : s + c] for s, c in zip(starts, plan_counts)])
        source = np.repeat(np.arange(ranks), plan_counts - local)
        from_prediction = places >= 0
        row = np.where(from_prediction, places, -1 - places)
        limit = np.where(from_prediction, predicted_recv[source], correction_recv[source])
        if (row >= limit).any() or per_source.sum() != places.size:
            raise RuntimeError(f"sample-assignment caching on rank {comm.rank}: the plan received names rows "
                               "that were not sent (the ranks ran different flows)")
        index = np.where(from_prediction, _first_rows(predicted_recv)[source] + row,
                         int(predicted_recv.sum()) + _first_rows(correction_recv)[source] + row)
        pool = torch.cat([pool_p, pool_c])
        received = _ReceivedByPrediction.apply(tokens, pool, torch.from_numpy(index).to(pool.device), perm,
                                               per_source.sum(axis=1), comm, algo)
        corrected = int(correction_send.sum() - correction_send[comm.rank])
        return Dispatched(received, per_source, perm, send), corrected
