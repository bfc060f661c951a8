"""Expert placement from routing history (the Deployment paper, Section VII).

A trace is a (B, E) array: row b holds the tokens (or routed choices) each
of the E experts received in batch b. The paper's A_mb is that row divided
by its sum, the share of the batch's tokens expert m took; its history
load is the mean over batches, Ã_m = mean_b A_mb. An assignment is a
(W, E/W) int64 array: row w lists the experts rank w holds, one per slot
(every rank holds E/W, as the paper asks).

Policies (experts taken by decreasing Ã_m, ties to the smaller id; each
goes to the rank of least cost among the ranks with a free slot, ties to
the smaller rank; each rank's row is then sorted):

- ``greedy`` (Section VII-A): the cost of rank n is its load,
  sum_{m on n} Ã_m.
- ``anti_correlation`` (Section VII-B): for expert a, the cost of rank n is
  sum_{m on n} (Ã_m + weight * S_am), S the Pearson correlation of the
  experts' shares over the batches (0 for an expert whose share never
  varies); the paper's weight is 0.5. Experts that rise and fall together
  are spread over different ranks.

Metrics (the paper's, on the batches of a trace that routed anything):
rank n's load in batch b is sum_{m on n} A_mb; ``max_load`` is its maximum
over every batch and rank (the worst case, which decides memory), and
``avg_max_load`` the mean over batches of the maximum over ranks (the
average bottleneck). 1/W is the floor of both. ``fit_and_evaluate`` fits a
policy on the first half of a trace and measures the second, as the paper.

A hand-worked case, 2 ranks, 4 experts, one batch with shares
(0.4, 0.3, 0.2, 0.1): identity [[0, 1], [2, 3]] gives a max load of 0.7;
greedy places 0 on rank 0, 1 on rank 1, 2 on rank 1 (0.3 < 0.4), 3 on
rank 0 (rank 1 is full): [[0, 3], [1, 2]], max load 0.5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "POLICIES",
    "anti_correlation",
    "as_assignment",
    "avg_max_load",
    "correlation",
    "fit_and_evaluate",
    "greedy",
    "identity",
    "max_load",
    "rank_loads",
    "shares",
]


def _trace(trace: Any) -> np.ndarray:
    """The trace as float64 (B, E), checked."""
    array = np.asarray(trace, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"trace must be (batches, experts) with at least one of each, got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("trace: every count must be finite and non-negative")
    return array


def shares(trace: Any) -> np.ndarray:
    """A_mb as (B', E): each batch's counts over its total, for the B' batches that routed anything."""
    array = _trace(trace)
    totals = array.sum(axis=1)
    routed = totals > 0
    if not routed.any():
        raise ValueError(f"trace: none of its {array.shape[0]} batches routed a token")
    return array[routed] / totals[routed, None]


def _ranks(ranks: Any, num_experts: int) -> int:
    if not isinstance(ranks, (int, np.integer)) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    if num_experts % ranks != 0:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ranks} ranks (E/W experts per rank)")
    return int(ranks)


def identity(num_experts: int, ranks: int) -> np.ndarray:
    """The layer's placement before any ``place``: rank w holds [w n, (w + 1) n)."""
    ranks = _ranks(ranks, num_experts)
    return np.arange(num_experts, dtype=np.int64).reshape(ranks, -1)


def as_assignment(assignment: Any, num_experts: int, ranks: int) -> np.ndarray:
    """`assignment` (a (W, n) array or list of lists) as int64 (W, n), or a
    ValueError that says what is wrong with it."""
    n = num_experts // ranks
    try:
        array = np.asarray(assignment)
    except ValueError as error:  # ragged lists
        raise ValueError(f"assignment must be a ({ranks}, {n}) array of expert ids: {error}") from None
    if array.shape != (ranks, n):
        raise ValueError(f"assignment must be ({ranks}, {n}): {n} experts for each of {ranks} ranks, "
                         f"got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"assignment must hold integer expert ids, got dtype {array.dtype}")
    array = array.astype(np.int64)
    outside = array[(array < 0) | (array >= num_experts)]
    if outside.size:
        raise ValueError(f"assignment: expert ids must be in [0, {num_experts}), got {sorted(set(outside.tolist()))}")
    counts = np.bincount(array.reshape(-1), minlength=num_experts)
    if (counts != 1).any():
        twice = np.flatnonzero(counts > 1).tolist()
        missing = np.flatnonzero(counts == 0).tolist()
        raise ValueError(f"assignment must hold every expert exactly once: experts {twice} appear more than once, "
                         f"experts {missing} not at all")
    return array


def _place(loads: np.ndarray, ranks: int, cost: Callable[[int, list[int]], float]) -> np.ndarray:
    """Experts by decreasing load onto the cheapest rank with a free slot."""
    num_experts = loads.size
    per_rank = num_experts // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    for expert in np.argsort(-loads, kind="stable").tolist():  # stable: ties to the smaller id
        open_ranks = [n for n in range(ranks) if len(held[n]) < per_rank]
        chosen = min(open_ranks, key=lambda n: (cost(expert, held[n]), n))
        held[chosen].append(expert)
    return np.array([sorted(row) for row in held], dtype=np.int64).reshape(ranks, per_rank)


def greedy(trace: Any, ranks: int) -> np.ndarray:
    """Section VII-A: by decreasing history load, each expert to the least loaded rank with room."""
    loads = shares(trace).mean(axis=0)
    ranks = _ranks(ranks, loads.size)
    return _place(loads, ranks, lambda expert, held: float(loads[held].sum()))


def correlation(trace: Any) -> np.ndarray:
    """S (E, E): Pearson correlation of the experts' shares over the batches;
    0 wherever an expert's share is constant (its correlation is undefined)."""
    a = shares(trace)
    centred = a - a.mean(axis=0)
    norms = np.sqrt((centred**2).sum(axis=0))
    varying = norms > 1e-12 * max(1.0, float(np.abs(a).max()))
    safe = np.where(varying, norms, 1.0)
    s = (centred.T @ centred) / np.outer(safe, safe)
    s[~varying, :] = 0.0
    s[:, ~varying] = 0.0
    return np.clip(s, -1.0, 1.0)


def anti_correlation(trace: Any, ranks: int, weight: float = 0.5) -> np.ndarray:
    """Section VII-B: as greedy, with rank n's cost for expert a
    sum_{m on n} (Ã_m + weight * S_am)."""
    if not np.isfinite(weight):
        raise ValueError(f"weight must be finite, got {weight!r}")
    loads = shares(trace).mean(axis=0)
    ranks = _ranks(ranks, loads.size)
    s = correlation(trace)
    return _place(loads, ranks, lambda expert, held: float((loads[held] + weight * s[expert, held]).sum()))


def rank_loads(trace: Any, assignment: Any) -> np.ndarray:
    """(B', W): each rank's share of each batch's tokens under `assignment`."""
    a = shares(trace)
    table = as_assignment(assignment, a.shape[1], _ranks(len(assignment), a.shape[1]))
    return a[:, table].sum(axis=2)


def max_load(trace: Any, assignment: Any) -> float:
    """The largest share of a batch's tokens any rank ever took (the paper's Max Load)."""
    return float(rank_loads(trace, assignment).max())


def avg_max_load(trace: Any, assignment: Any) -> float:
    """The mean over batches of the largest rank's share (the paper's Avg Max Load)."""
    return float(rank_loads(trace, assignment).max(axis=1).mean())


POLICIES: dict[str, Callable[[Any, int], np.ndarray]] = {
    "identity": lambda trace, ranks: identity(np.asarray(trace).shape[1], ranks),
    "greedy": greedy,
    "anti_correlation": anti_correlation,
}


def fit_and_evaluate(trace: Any, ranks: int, policies: Sequence[str] = tuple(POLICIES)) -> dict[str, dict[str, Any]]:
    """Each policy fitted on the first half of the batches and measured on the
    second: {name: {"assignment", "max_load", "avg_max_load"}}."""
    array = _trace(trace)
    if array.shape[0] < 2:
        raise ValueError(f"trace: fitting on one half and evaluating on the other needs 2 batches at least, "
                         f"got {array.shape[0]}")
    unknown = [name for name in policies if name not in POLICIES]
    if unknown:
        raise ValueError(f"unknown placement policies {unknown}; known: {list(POLICIES)}")
    half = array.shape[0] // 2
    fit, test = array[:half], array[half:]
    results = {}
    for name in policies:
        assignment = POLICIES[name](fit, ranks)
        results[name] = {"assignment": assignment, "max_load": max_load(test, assignment),
                         "avg_max_load": avg_max_load(test, assignment)}
    return results
