"""Locality-first token routing over vExpert replicas (FlexMoE, Algorithm 3).

Inputs, the same on every rank: ``demand`` (W, E) int64, I_{e,g}: the
routed choices of expert e on rank g (every rank's gate counts, all-gathered),
and ``replicas`` (E, W) int64, n_{e,g} (moe_runtime.flex.vexperts). For expert e
with I_e = sum_g I_{e,g} choices and n_e = sum_g n_{e,g} vExperts:

    target_g = I_e n_{e,g} / n_e       rank g's share (cap_e n_{e,g}, cap_e = I_e / n_e),
                                       in integers: floors, then the remainders
                                       one each to the largest fractions (ties: lower rank)
    keep_g   = min(target_g, I_{e,g})  locality first: served where they are
    spill_g  = I_{e,g} - keep_g        to other ranks
    spare_g  = target_g - keep_g       room left on rank g (0 where g spills)

Each spilling rank, in rank order, splits its spill over the others in
proportion to their remaining spare room (largest remainders again, ties
to the lower rank) and takes that room. Spill and spare totals are equal,
so every rank ends with exactly its target: every choice is served once,
each rank processes sum_e target_g, and the balance ratio of Equation 6 is
that over the mean.

Output ``sends`` (E, W, W) int64: sends[e, g, h] choices of expert e that
rank g sends to rank h (h = g: kept). Row sums are the demand; column sums
the targets. A hand-worked case, one expert, 2 ranks, one vExpert each,
demand (5, 1): targets (3, 3), rank 0 keeps 3 and sends 2 to rank 1, which
keeps its 1: sends[0] = [[3, 2], [0, 1]].
"""

from __future__ import annotations

import numpy as np

__all__ = ["balance_ratio", "rank_loads", "route", "variance_ratio"]


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to `weights` (int64 >= 0, positive sum) summing
    to `total`: floors, then one each to the largest remainders (ties: lower
    index). Exact integer arithmetic, so every rank gets the same answer;
    each share is at most the ceiling of its exact value."""
    weights = weights.astype(np.int64)
    whole = int(weights.sum())
    shares, remainders = np.divmod(total * weights, whole)
    left = total - int(shares.sum())
    if left:
        order = np.lexsort((np.arange(weights.size), -remainders))
        shares[order[:left]] += 1
    return shares


def route(demand: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """sends (E, W, W) of Algorithm 3 (see the module docstring)."""
    demand = np.asarray(demand, dtype=np.int64)
    replicas = np.asarray(replicas, dtype=np.int64)
    ranks, num_experts = demand.shape
    if replicas.shape != (num_experts, ranks):
        raise ValueError(f"route: replicas must be (E, W) = ({num_experts}, {ranks}) to match demand (W, E), "
                         f"got {replicas.shape}")
    if (demand < 0).any() or (replicas < 0).any():
        raise ValueError("route: demand and replicas must be non-negative")
    sends = np.zeros((num_experts, ranks, ranks), dtype=np.int64)
    for e in range(num_experts):
        local = demand[:, e]
        total = int(local.sum())
        if total == 0:
            continue
        if replicas[e].sum() == 0:
            raise ValueError(f"route: expert {e} has {total} choices but no vExpert serves it")
        target = _apportion(total, replicas[e])
        keep = np.minimum(target, local)
        sends[e, np.arange(ranks), np.arange(ranks)] = keep
        spill, spare = local - keep, target - keep
        # Spill and spare totals are equal, so the spare of the ranks still to
        # serve is always at least a sender's spill: each share fits its room.
        for g in np.flatnonzero(spill).tolist():
            share = _apportion(int(spill[g]), spare)
            sends[e, g] += share
            spare -= share
    return sends


def rank_loads(sends: np.ndarray) -> np.ndarray:
    """(W,) choices each rank's vExperts process."""
    return np.asarray(sends).sum(axis=(0, 1))


def balance_ratio(loads: np.ndarray) -> float:
    """Equation 6: the most a rank processes over the mean (1 when nothing is routed)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean()
    return 1.0 if mean == 0 else float(loads.max() / mean)


def variance_ratio(loads: np.ndarray) -> float:
    """Section 5.3's variance of the ranks' loads, over the squared mean (0 when nothing is routed)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean()
    return 0.0 if mean == 0 else float(loads.var() / mean**2)
