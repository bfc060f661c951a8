"""Per-expert dynamic capacity (DynaMoE, Section 4.1): the policy that picks
each expert's capacity from the counts the gate produced.

A static capacity factor gives every expert the same rows, so the factor
that drops nothing pads every expert to the busiest one's demand. DynaMoE
measures how many choices each expert gets and gives each expert its own
capacity, adjusted over training. Here, per call of the layer:

    demand[e]  = the most choices expert e gets on any rank (agreed: an
                 all-reduce max of every rank's counts, with the token count)
    average[e] = momentum * average[e] + (1 - momentum) * demand[e]
                 (the first call: demand[e])
    grow at once:  demand[e] > capacity[e]
                   -> capacity[e] = up(margin * demand[e])
    shrink slowly: up(margin * average[e]) < shrink_band * capacity[e] for
                   shrink_patience calls in a row
                   -> capacity[e] = max(up(margin * average[e]), up(demand[e]))
    bound:         capacity[e] <= up(ceil(max_factor * k * T / E)) when
                   max_factor is set (T: the most tokens on any rank)

where up(x) rounds x up to a multiple of `granularity`. The demand is agreed
before the call's routing, so an overflowing expert grows in the same call:
nothing is dropped unless max_factor bounds the capacity. The hysteresis
(grow at once, shrink only after a lasting fall, in steps of at least the
band) keeps the capacities, and so the buffers' shapes, unchanged over most
calls; ``changes`` counts the calls that changed them (DynaMoE's
recompilations). Every input is agreed, so every rank computes the same
capacities (the routing's agreement, a max, would also make them equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CapacityTracker", "DynamicCapacity"]


@dataclass(frozen=True)
class DynamicCapacity:
    """Settings of the per-expert capacity policy (see the module docstring).

    ``margin`` (default 1.25): capacity over the expected demand, >= 1.
    ``momentum`` (0.9): weight of the past in the moving average, in [0, 1).
    ``shrink_band`` (0.75): shrink only when the target is below this
    fraction of the capacity, in (0, 1]. ``shrink_patience`` (8): for this
    many calls in a row, >= 1. ``granularity`` (8): capacities are multiples
    of it, >= 1. ``max_factor`` (None): at most ceil(max_factor * k * T / E)
    rows per expert (rounded up to the granularity); choices beyond it are
    dropped. None: no bound, nothing dropped.
    """

    margin: float = 1.25
    momentum: float = 0.9
    shrink_band: float = 0.75
    shrink_patience: int = 8
    granularity: int = 8
    max_factor: float | None = None

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"DynamicCapacity: {name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicCapacity: {name} must be an integer >= 1, got {value!r}")
            return value

        if number("margin") < 1.0:
            raise ValueError(f"DynamicCapacity: margin must be >= 1, got {self.margin}")
        if not 0.0 <= number("momentum") < 1.0:
            raise ValueError(f"DynamicCapacity: momentum must be in [0, 1), got {self.momentum}")
        if not 0.0 < number("shrink_band") <= 1.0:
            raise ValueError(f"DynamicCapacity: shrink_band must be in (0, 1], got {self.shrink_band}")
        integer("shrink_patience")
        integer("granularity")
        if self.max_factor is not None and number("max_factor") <= 0:
            raise ValueError(f"DynamicCapacity: max_factor must be > 0 or None, got {self.max_factor}")


class CapacityTracker:
    """The policy's state for one layer: ``capacities`` (E,) int64 (None
    before the first call), ``average`` (E,) float64, ``changes`` (calls
    that changed the capacities, the first one included)."""

    def __init__(self, settings: DynamicCapacity, num_experts: int):
        if not isinstance(settings, DynamicCapacity):
            raise TypeError(f"dynamic_capacity must be a moe_runtime.DynamicCapacity, got {type(settings).__name__}")
        self.settings, self.num_experts = settings, num_experts
        self.capacities: np.ndarray | None = None
        self.average = np.zeros(num_experts, dtype=np.float64)
        self.changes = 0
        self._low_calls = np.zeros(num_experts, dtype=np.int64)  # calls in a row below the shrink band

    def _up(self, rows: np.ndarray) -> np.ndarray:
        g = self.settings.granularity
        return (np.ceil(np.asarray(rows, dtype=np.float64) / g) * g).astype(np.int64)

    def update(self, demand: np.ndarray, num_tokens: int, top_k: int) -> np.ndarray:
        """This call's capacities from its agreed `demand` (E,) (the most
        choices of each expert on any rank) and `num_tokens` (the most tokens
        on any rank). Returns a new (E,) int64 array."""
        capacities, self.average, self._low_calls = self._next(demand, num_tokens, top_k)
        if self.capacities is None or not np.array_equal(capacities, self.capacities):
            self.changes += 1
        self.capacities = capacities
        return capacities.copy()

    def peek(self, demand: np.ndarray, num_tokens: int, top_k: int) -> np.ndarray:
        """The capacities :meth:`update` would return, the state unchanged."""
        return self._next(demand, num_tokens, top_k)[0]

    def _next(self, demand: np.ndarray, num_tokens: int, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(capacities, average, calls below the band) after a call of `demand`."""
        s = self.settings
        demand = np.asarray(demand, dtype=np.int64)
        if demand.shape != (self.num_experts,) or (demand < 0).any():
            raise ValueError(f"CapacityTracker.update: demand must be ({self.num_experts},) counts >= 0, "
                             f"got {demand.tolist()}")
        previous, low_calls = self.capacities, self._low_calls
        if previous is None:
            average = demand.astype(np.float64)
            capacities = self._up(s.margin * demand)
        else:
            average = s.momentum * self.average + (1.0 - s.momentum) * demand
            capacities = previous.copy()
            grow = demand > previous
            # A capacity is never below its average (it is set to at least margin
            # times it), so an overflowing demand is above the average too.
            capacities[grow] = self._up(s.margin * demand)[grow]
            target = self._up(s.margin * average)
            low = ~grow & (target < s.shrink_band * previous)
            low_calls = np.where(low, low_calls + 1, 0)
            shrink = low_calls >= s.shrink_patience
            capacities[shrink] = np.maximum(target, self._up(demand))[shrink]
            low_calls[shrink] = 0
        if s.max_factor is not None:
            bound = math.ceil(s.max_factor * top_k * num_tokens / self.num_experts)
            capacities = np.minimum(capacities, self._up(np.array([bound]))[0])
        return capacities, average, low_calls

    def __repr__(self) -> str:
        shown = None if self.capacities is None else self.capacities.tolist()
        return f"CapacityTracker({self.settings}, capacities={shown}, changes={self.changes})"
