"""FlexMoE's scheduler and policy maker (Algorithms 1 and 2, Section 3.3's Migrate).

Every step the layer hands the scheduler a StepSample (:meth:`Scheduler.observe`)
and asks it for a plan for the next demand (:meth:`Scheduler.plan`). The
trigger's metric is computed on the ranks' loads under Algorithm 3's routing,
loads = rank_loads(route(demand, table.replicas())):

    balance  = max_g loads_g / mean(loads)          (Equation 6)
    variance = var(loads) / mean(loads)^2           (Section 5.3's alternative)

Algorithm 2 (:func:`policy_step`), with I_e = sum_g I_{e,g} and n_e the
slots serving e: cap_e = I_e / n_e; e0 = argmax cap_e, e1 = argmin cap_e over
the experts with n_e >= 2 (ties: the lower id). The candidates are
[Shrink(p), Expand(e0, p)] for every slot p of e1 and [Expand(e0, p)] for every
FREE slot p; each is priced

    t1 = T(table after) + adjustment / horizon_steps      (Eq. 5, CostModel)

and the cheapest (the first on ties) is returned when t1 < t0 = T(table).
Algorithm 1 applies such steps while the metric exceeds the threshold, at most
``max_plans`` of them, then Migrate (:func:`migrate_plan`): the swap of two
slots that lowers the replica spread (sum over experts of the ranks they
span) and the predicted cost the most, again and again while one does.

Everything is a function of the samples and the arguments, so every rank
makes the same decision.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .config import FlexConfig
from .cost import Breakdown, CostModel, StepSample, checked_demand
from .routing import balance_ratio, rank_loads, route, variance_ratio
from .vexperts import FREE, Expand, Migrate, Primitive, Shrink, SlotTable

__all__ = ["Decision", "Scheduler", "migrate_plan", "planned_cost", "policy_step", "replica_spread",
           "trigger_metric"]


def trigger_metric(table: SlotTable, demand: np.ndarray, trigger: str) -> float:
    """The trigger's metric ("balance": Eq. 6, "variance": Section 5.3) of `demand` routed over `table`."""
    loads = rank_loads(route(checked_demand(demand, table), table.replicas()))
    if trigger == "balance":
        return balance_ratio(loads)
    if trigger == "variance":
        return variance_ratio(loads)
    raise ValueError(f"trigger must be 'balance' or 'variance', got {trigger!r}")


def replica_spread(table: SlotTable) -> int:
    """sum over experts of the ranks holding a replica (E when none is replicated across ranks)."""
    return int((table.replicas() > 0).sum())


def planned_cost(table: SlotTable, demand: np.ndarray, model: CostModel, primitives: list[Primitive],
                 horizon: int) -> tuple[float, SlotTable]:
    """t1 = T(table after `primitives`) + their adjustment seconds / `horizon`, and that table."""
    after, transfer = table.apply(primitives)
    return model.predict(after, demand).total_s + model.adjustment_seconds(table, transfer) / horizon, after


def policy_step(table: SlotTable, demand: np.ndarray, model: CostModel, horizon: int) -> list[Primitive]:
    """Algorithm 2: [Shrink(p), Expand(e0, p)] or [Expand(e0, p)] when the model
    predicts a gain, else [] (see the module docstring)."""
    demand = checked_demand(demand, table)
    _check_horizon(horizon)
    load, serving = demand.sum(axis=0), table.replicas().sum(axis=1)
    cap = load / serving
    hot = int(np.argmax(cap))
    if load[hot] == 0:
        return []
    options = [[Expand(hot, slot)] for slot in np.flatnonzero(table.slots.reshape(-1) == FREE).tolist()]
    shrinkable = (serving >= 2) & (np.arange(cap.size) != hot)
    if shrinkable.any():
        cold = int(np.flatnonzero(shrinkable)[np.argmin(cap[shrinkable])])
        options += [[Shrink(slot), Expand(hot, slot)] for slot in table.slots_of(cold)]
    best, best_cost = [], model.predict(table, demand).total_s
    for option in options:
        cost, _ = planned_cost(table, demand, model, option, horizon)
        if cost < best_cost:
            best, best_cost = option, cost
    return best


def migrate_plan(table: SlotTable, demand: np.ndarray, model: CostModel, horizon: int) -> list[Migrate]:
    """Migrate (Algorithm 1, line 9): repeatedly the swap that lowers the replica
    spread with the lowest t1 < t0 (first on ties), until none does."""
    demand = checked_demand(demand, table)
    _check_horizon(horizon)
    plan: list[Migrate] = []
    while (swap := _best_swap(table, demand, model, horizon)) is not None:
        plan.append(swap)
        table, _ = table.apply([swap])
    return plan


def _best_swap(table: SlotTable, demand: np.ndarray, model: CostModel, horizon: int) -> Migrate | None:
    best, best_cost = None, model.predict(table, demand).total_s
    spread = replica_spread(table)
    for swap in _gathering_swaps(table):
        cost, after = planned_cost(table, demand, model, [swap], horizon)
        if replica_spread(after) < spread and cost < best_cost:
            best, best_cost = swap, cost
    return best


def _gathering_swaps(table: SlotTable) -> Iterator[Migrate]:
    """Swaps moving a replica of a multi-rank expert e onto another rank holding e:
    for e ascending, e's slots a ascending, those ranks ascending, their slots b not serving e."""
    per_rank, seen = table.slots_per_rank, set()
    for expert, ranks in table.replica_groups():
        for a in table.slots_of(expert):
            for rank in ranks:
                if rank == a // per_rank:
                    continue
                for b in range(rank * per_rank, (rank + 1) * per_rank):
                    pair = (min(a, b), max(a, b))
                    if table.slots[rank, b - rank * per_rank] != expert and pair not in seen:
                        seen.add(pair)
                        yield Migrate(*pair)


def _check_horizon(horizon: int) -> None:
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise ValueError(f"horizon must be a positive integer (steps), got {horizon!r}")


@dataclass(frozen=True)
class Decision:
    """What :meth:`Scheduler.plan` decided for one step.

    ``primitives``: to apply in order (empty: keep the table); ``metric`` /
    ``triggered``: the trigger's metric now and whether it exceeds the
    threshold; ``predicted_before`` / ``predicted_after``: Eq. 5 for the
    table now and after the primitives (None before the model is fitted);
    ``adjustment_s``: the predicted seconds of applying them (None before);
    ``metric_after``; ``table_after``."""

    primitives: list
    metric: float
    triggered: bool
    predicted_before: Breakdown | None
    predicted_after: Breakdown | None
    adjustment_s: float | None
    metric_after: float
    table_after: SlotTable


class Scheduler:
    """Algorithm 1 over a CostModel fitted on the job's StepSamples.

    ``observe(sample)`` keeps the last `window` samples and refits the model
    once ``config.calibration_steps`` (at least 1) are in; ``plan(table, demand)``
    returns a :class:`Decision`. Migrate is searched at every fitted call
    (Algorithm 1 runs it at every monitoring step), except on the table the
    last search ended with: that one it already left as it was."""

    def __init__(self, config: FlexConfig, model: CostModel, window: int = 16):
        if not isinstance(config, FlexConfig):
            raise TypeError(f"Scheduler: config must be a FlexConfig, got {type(config).__name__}")
        if not isinstance(model, CostModel):
            raise TypeError(f"Scheduler: model must be a CostModel, got {type(model).__name__}")
        if isinstance(window, bool) or not isinstance(window, int) or window < max(1, config.calibration_steps):
            raise ValueError(f"Scheduler: window must be an integer >= max(1, calibration_steps="
                             f"{config.calibration_steps}), got {window!r}")
        self.config, self.model = config, model
        self._window: deque[StepSample] = deque(maxlen=window)
        self._settled: SlotTable | None = None

    @property
    def samples(self) -> tuple[StepSample, ...]:
        return tuple(self._window)

    def observe(self, sample: StepSample) -> None:
        """Keep `sample`; refit the model once enough are in."""
        if not isinstance(sample, StepSample):
            raise TypeError(f"Scheduler.observe: needs a StepSample, got {type(sample).__name__}")
        if self._window:
            self._check_shape(sample.table, "sample.table")
        self._window.append(sample)
        if len(self._window) >= max(1, self.config.calibration_steps):
            self.model.fit(self._window)

    def plan(self, table: SlotTable, demand: np.ndarray) -> Decision:
        """Algorithm 1 for one step: Expand/Shrink (Algorithm 2) while the metric
        exceeds the threshold, at most max_plans times, then Migrate."""
        demand = checked_demand(demand, table)
        self._check_shape(table, "table")
        trigger, horizon = self.config.trigger, self.config.horizon_steps
        metric = trigger_metric(table, demand, trigger)
        triggered = metric > self.config.threshold
        if not self.model.fitted:
            return Decision([], metric, triggered, None, None, None, metric, table)
        primitives, current, current_metric = [], table, metric
        for _ in range(self.config.max_plans if triggered else 0):
            step = policy_step(current, demand, self.model, horizon)
            if not step:
                break
            primitives += step
            current, _ = current.apply(step)
            current_metric = trigger_metric(current, demand, trigger)
            if current_metric <= self.config.threshold:
                break
        if self.config.migrate and current != self._settled:
            swaps = migrate_plan(current, demand, self.model, horizon)
            primitives += swaps
            current, _ = current.apply(swaps)
            self._settled = current
            current_metric = trigger_metric(current, demand, trigger)
        return self._decision(table, demand, primitives, metric, triggered, current_metric)

    def _decision(self, table: SlotTable, demand: np.ndarray, primitives: list[Primitive], metric: float,
                  triggered: bool, metric_after: float) -> Decision:
        after, transfer = table.apply(primitives)
        return Decision(primitives, metric, triggered, self.model.predict(table, demand),
                        self.model.predict(after, demand), self.model.adjustment_seconds(table, transfer),
                        metric_after, after)

    def _check_shape(self, table: SlotTable, name: str) -> None:
        if not self._window:
            return
        known = self._window[0].table
        if (table.ranks, table.num_experts) != (known.ranks, known.num_experts):
            raise ValueError(f"Scheduler: {name} has {table.ranks} ranks and {table.num_experts} experts, the "
                             f"samples {known.ranks} and {known.num_experts}")
