"""FlexConfig: the settings of FlexMoE in the layer (``MoELayer(flow=FlexConfig(...))``).

FlexMoE (Nie et al., 2023) gives hot experts more vExpert slots (replicas)
and routes tokens to them; the scheduler watches the balance ratio every
step and asks the policy maker for Expand / Shrink pairs while the cost
model predicts a gain, then Migrates to gather replicas on fewer ranks
(moe_runtime.flex.scheduler). docs/runtime.md "FlexMoE" draws the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TRIGGERS", "FlexConfig"]

TRIGGERS = ("balance", "variance")


@dataclass(frozen=True)
class FlexConfig:
    """Settings of FlexMoE (see the module docstring).

    ``slots_per_rank``: vExpert slots on every rank, at least the layer's
    experts per rank n (None: 2 n, room for one extra replica per expert).
    At the start rank w holds the plain layer's experts [w n, (w + 1) n) in
    its first n slots and the others are FREE: replicas appear where the
    scheduler (or ``MoELayer.adjust``) puts them.
    ``threshold`` (1.2): the scheduler plans when the trigger's metric
    exceeds it. ``trigger``: ``"balance"`` (Equation 6: the most tokens a
    rank's vExperts process over the mean, >= 1) or ``"variance"`` (Section
    5.3's alternative: the variance of the ranks' tokens over the squared
    mean, so that one threshold reads the same at any batch size; >= 0).
    ``max_plans`` (8): Expand/Shrink pairs at most per scheduling (Algorithm
    1's inner loop). ``horizon_steps`` (50): the steps an adjustment is
    expected to pay for; its one-off cost is spread over them when the
    policy maker weighs it against the gain per step. ``migrate`` (True):
    Migrate after Expand/Shrink (Algorithm 1, line 9).
    ``calibration_steps`` (3): steps measured before the first scheduling
    (the cost model is fitted on the job's own timings).
    """

    slots_per_rank: int | None = None
    threshold: float = 1.2
    trigger: str = "balance"
    max_plans: int = 8
    horizon_steps: int = 50
    migrate: bool = True
    calibration_steps: int = 3

    def __post_init__(self) -> None:
        if self.slots_per_rank is not None and (not _is_int(self.slots_per_rank) or self.slots_per_rank < 1):
            raise ValueError(f"FlexConfig: slots_per_rank must be a positive integer or None, "
                             f"got {self.slots_per_rank!r}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"FlexConfig: trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise ValueError(f"FlexConfig: threshold must be a finite number, got {self.threshold!r}")
        if self.trigger == "balance" and self.threshold < 1:
            raise ValueError(f"FlexConfig: the balance ratio is >= 1, so threshold={self.threshold} would plan on "
                             "every step; give a threshold >= 1")
        if self.trigger == "variance" and self.threshold < 0:
            raise ValueError(f"FlexConfig: the variance ratio is >= 0, got threshold={self.threshold}")
        for name in ("max_plans", "horizon_steps", "calibration_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < (0 if name == "calibration_steps" else 1):
                raise ValueError(f"FlexConfig: {name} must be a {'non-negative' if name == 'calibration_steps' else 'positive'} "
                                 f"integer, got {value!r}")

    def slots_for(self, experts_per_rank: int) -> int:
        """S for a layer with n experts per rank (checked: S >= n)."""
        slots = 2 * experts_per_rank if self.slots_per_rank is None else self.slots_per_rank
        if slots < experts_per_rank:
            raise ValueError(f"FlexConfig: slots_per_rank={slots} cannot hold the layer's {experts_per_rank} experts "
                             "per rank; give at least that many")
        return slots


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
