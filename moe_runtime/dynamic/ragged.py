"""The per-expert capacity flow's exchange (DynaMoE's dynamic capacity factors):
each expert has its own capacity C_e (moe_runtime.dynamic.capacity picks
them), the same on every rank, and the buffers hold sum_e C_e rows instead
of E times the largest.

One call, r = 1 (each rank holds n whole experts: E = n W), d = 1::

    tokens (T, M), indices (T, k), capacities C (E,) agreed
    a2a.route(capacity=C)  -> ragged layout: expert e owns rows
                              [o_e, o_e + C_e), o = prefix sums of C
    fast_encode            -> dispatched (sum C, M), padding rows zero
    all_to_all_v           -> rank j gets the rows of its experts,
                              [o_{jn}, o_{(j+1)n}); every rank sends the same
                              S_j = C_{jn} + ... + C_{jn+n-1} rows to rank j,
                              so rank j receives (W, S_j, M), source-major
    FFN of local expert e on its (W, C_e, M) rows (one slice per source),
                              grouped expert-major for ragged_ffn.py
    all_to_all_v back      -> (sum C, M) in dispatched's order
    fast_decode with the gates -> y (T, M)

Unlike the dropless flow no count exchange is needed (the layout is
known from C alone) and the shapes stay the same while C does; unlike the
expert flow no expert is padded to the busiest one. Every step is a
differentiable a2a.torch function or torch op, so autograd runs the reverse
flow. r = 1 with whole experts and d = 1, for the dropless flow's
reasons (moe_runtime.deployment.dropless).
"""

from __future__ import annotations

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from ..experts.activation import Activation
from ..experts.ragged_ffn import ragged_ffn

__all__ = ["ragged_moe"]


def ragged_moe(tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None, *, capacities: np.ndarray,
               weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None], activation: Activation, comm: a2a.Comm, algo: str,
               is_postscore: bool = True, scores: torch.Tensor | None = None, weight_grad_scale: float = 1.0,
               ) -> tuple[torch.Tensor, a2a.Routing, int]:
    """y (T, M) of this rank's tokens, the routing (its ``num_dropped``
    counts this rank's dropped choices), and the rows this rank sent to other
    ranks (in each exchange). `capacities` (E,) must be the same on every
    rank (the routing agrees them by their maximum); `weights` are this
    rank's (fc1 (n, H, M), fc1_bias (n, H) or None, fc2 (n, H, M), fc2_bias
    (n, M) or None); `gates` (T, k) weigh the expert outputs at the combine
    (is_postscore) or the inputs at the dispatch; `scores` (T, E), when
    given, order who is dropped (Batch Prioritized Routing)."""
    local, world, rank = weights[0].shape[0], comm.size, comm.rank
    model_dim = tokens.shape[1]
    routing = a2a.route(indices, local * world, capacity=capacities, scores=scores,
                        batch_prioritized=scores is not None, comm=comm)
    agreed = routing.capacity.reshape(world, local)  # (W, n): rank j's experts in row j
    per_rank = agreed.sum(axis=1)
    dispatched = a2a_torch.fast_encode(tokens, routing, None if is_postscore else gates)
    received, recv_counts = a2a_torch.all_to_all_v(dispatched, per_rank, comm=comm, algo=algo)

    mine = agreed[rank]
    starts = np.concatenate([[0], np.cumsum(mine)]).tolist()
    by_source = received.view(world, int(per_rank[rank]), model_dim)
    # Expert-major for the FFN (expert e's W C_e rows contiguous), source-major again after.
    by_expert = torch.cat([by_source[:, starts[e] : starts[e + 1]].reshape(-1, model_dim) for e in range(local)])
    offsets = [world * start for start in starts]
    out = ragged_ffn(by_expert, offsets, *weights, activation, weight_grad_scale)
    computed = torch.cat([out[offsets[e] : offsets[e + 1]].view(world, int(mine[e]), model_dim)
                          for e in range(local)], dim=1).reshape(-1, model_dim)
    returned, _ = a2a_torch.all_to_all_v(computed, recv_counts, comm=comm, algo=algo)
    y = a2a_torch.fast_decode(returned, routing, gates if is_postscore else None)
    return y, routing, int(per_rank.sum() - per_rank[rank])
