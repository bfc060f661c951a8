"""FlexMoE in one layer: the vExpert table, the step's plan and measurements,
the scheduler's pending adjustment and the primitives that carry it out.

Per call (collective, every input agreed so every rank decides the same)::

    demand (W, E): one all-gather of every rank's routed choices per expert,
        carrying the previous call's measurements (rows, seconds of compute,
        exchange and each replica all-reduce, the step's time)
    previous call's StepSample -> scheduler.observe (fits the cost model)
    sends = route(demand, table.replicas())      Algorithm 3
    history += balance ratio, loads, the model's prediction of this step
    scheduler.plan(table, demand)                Algorithms 1-2 and Migrate:
        queued; ``MoELayer.rebalance(optimizer)`` applies it after the
        optimizer's step
    flex_dispatch.flex_moe(...)                  the flow; its backward
        all-reduces the replicas' gradients (ascending expert id)

A recomputation (activation checkpointing: moe_runtime.common.recompute) is
no new call: it routes by the same all-gather, with no measurements in it,
and leaves the history, the plan and the measured call as they are (but for
a forward that recorded no backward, a reentrant checkpoint's, whose
measurements the recomputation's backward takes over).

Replica groups talk over sub-communicators split from the layer's, made at
construction and after each adjustment (collective points of every rank)
and kept in a least-recently-used cache, as FlexMoE keeps NCCL groups.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import a2a

from ..common.host_values import all_gather_values
from ..common.recompute import recomputing
from ..experts.ragged_ffn import ComputeClock
from ..experts.relocation import Moved, agree_on_move, copy_slots
from .config import FlexConfig
from .cost import CostModel, StepSample
from .dispatch import FlexCall, ReplicaSync
from .routing import balance_ratio, rank_loads, route, variance_ratio
from .scheduler import Decision, Scheduler
from .vexperts import Primitive, SlotTable

__all__ = ["FlexState"]

MAX_GROUPS = 64  # cached replica-group communicators (least recently used beyond it are dropped)
_MEASURED = 5  # per rank: has a sample, rows, compute s, exchange s, step s


class FlexState:
    """FlexMoE's state in a layer (see the module docstring): ``table``
    (:class:`SlotTable`), ``history`` (one dict per call), ``pending`` (the
    scheduler's last :class:`Decision`), ``scheduler`` and ``cost_model``;
    ``last_demand`` (W, E) and ``last_sends`` (E, W, W), the last call's
    agreed counts and Algorithm 3's plan of them."""

    def __init__(self, config: FlexConfig, *, comm: a2a.Comm, num_experts: int, experts_per_rank: int,
                 model_dim: int, hidden: int, with_biases: tuple[bool, bool], timer: Callable[[], float]):
        if not isinstance(config, FlexConfig):
            raise TypeError(f"flex must be a moe_runtime.FlexConfig, got {type(config).__name__}")
        self.config, self.comm, self.timer = config, comm, timer
        self.table = SlotTable.plain(num_experts, comm.size, config.slots_for(experts_per_rank))
        self.model_dim = model_dim
        # Elements of one expert's parameters (fc1, fc2, and the biases the layer has).
        self.expert_elements = 2 * hidden * model_dim + hidden * with_biases[0] + model_dim * with_biases[1]
        self.history: list[dict[str, Any]] = []
        self.pending: Decision | None = None
        self.cost_model: CostModel | None = None  # made at the first call (it needs the dtype)
        self.scheduler: Scheduler | None = None
        self._groups: OrderedDict[tuple[int, ...], a2a.Comm | None] = OrderedDict()
        self._last: tuple[FlexCall, np.ndarray, SlotTable, np.ndarray, int] | None = None
        self.last_demand: np.ndarray | None = None
        self.last_sends: np.ndarray | None = None
        self._ensure_groups()

    # -- one call -----------------------------------------------------------------
    def begin(self, indices: torch.Tensor, step_seconds: float | None, element_bytes: int,
              state_bytes_per_slot: int, algo: str, recording: bool = True) -> tuple[np.ndarray, ReplicaSync]:
        """Collective, before the flow: (sends (E, W, W), the call's ReplicaSync)."""
        recomputed = recomputing()
        if self.scheduler is None:
            self.cost_model = CostModel(self.model_dim, element_bytes, self.expert_elements * element_bytes,
                                        state_bytes_per_slot, algo=algo)
            self.scheduler = Scheduler(self.config, self.cost_model)
        num_experts, ranks = self.table.num_experts, self.comm.size
        counts = torch.bincount(indices.reshape(-1), minlength=num_experts).cpu().numpy()
        measured = self._measurements(None if recomputed else step_seconds)  # None: no sample in it
        gathered = all_gather_values(np.concatenate([counts, measured]), self.comm).reshape(ranks, -1)
        demand = gathered[:, :num_experts].astype(np.int64)
        if self._last is not None and (gathered[:, num_experts] > 0).all():
            self._observe(gathered[:, num_experts:])
        sends = route(demand, self.table.replicas())
        loads = rank_loads(sends)
        call = FlexCall(int(loads[self.comm.rank]), ComputeClock(self.timer), recorded=recording)
        if recomputed:  # no new call: only a forward that recorded no backward hands its measurements over
            if self._last is not None and not self._last[0].recorded:
                self._last = (call, *self._last[1:])
        else:
            self.last_demand, self.last_sends = demand, sends
            model = self.cost_model
            predicted = model.predict(self.table, demand).total_s if model.fitted else None
            self.pending = self.scheduler.plan(self.table, demand)
            self.history.append({"balance_ratio": balance_ratio(loads), "variance_ratio": variance_ratio(loads),
                                 "loads": loads.tolist(), "predicted_s": predicted, "measured_s": None,
                                 "planned": len(self.pending.primitives), "applied": 0})
            self._last = (call, demand, self.table, sends, element_bytes)
        return sends, ReplicaSync(self.table, self.comm.rank, dict(self._groups), self.timer, call)

    def _measurements(self, step_seconds: float | None) -> np.ndarray:
        """This rank's row of the previous call: has-sample, rows, seconds of
        compute, exchange and the step, then each replica all-reduce's seconds
        (NaN where this rank was not in the group), in the table's group order."""
        if self._last is None:
            return np.zeros(_MEASURED, dtype=np.float64)
        call, _, table, _, _ = self._last
        # A call without backward (inference) timed no replica all-reduce: no sample when the table has replicas.
        complete = step_seconds is not None and (call.backward_done or not table.replica_groups())
        row = [float(complete), call.rows, call.compute.seconds, call.exchange_s,
               step_seconds if complete else math.nan]
        row += [call.sync_s.get(expert, math.nan) for expert, _ in table.replica_groups()]
        return np.array(row, dtype=np.float64)

    def _observe(self, measured: np.ndarray) -> None:
        """The previous call's StepSample from every rank's measurements, to the scheduler."""
        _, demand, table, sends, element_bytes = self._last
        groups = table.replica_groups()
        row_bytes = self.model_dim * element_bytes
        sync = tuple((expert, ranks, self.expert_elements * element_bytes, measured[:, _MEASURED + i].copy())
                     for i, (expert, ranks) in enumerate(groups))
        step_s = float(measured[:, 4].max())
        self.history[-1]["measured_s"] = step_s
        self.scheduler.observe(StepSample(
            demand=demand, table=table, rows=measured[:, 1].astype(np.int64), compute_s=measured[:, 2].copy(),
            exchange_bytes=sends.sum(axis=0) * row_bytes, exchange_s=measured[:, 3].copy(), sync=sync,
            step_s=step_s, element_bytes=element_bytes))

    # -- adjustments -----------------------------------------------------------------
    def adjust(self, primitives: Sequence[Primitive], experts: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> Moved:
        """Collective: applies `primitives` (the same list on every rank) to the
        table and the slots' parameters, gradients and optimizer state."""
        primitives = list(primitives)
        name = f"MoELayer.adjust on rank {self.comm.rank}"
        outcome: list = []

        def describe() -> bytes:
            outcome.extend(self.table.apply(primitives))
            return repr(primitives).encode()

        tensors = agree_on_move(self.comm, name, experts, optimizer, describe, "primitives")
        table, transfer = outcome
        moved = copy_slots(tensors, transfer.source, self.comm)
        self.table = table
        self._last = None  # measurements of the old table do not describe the new one
        self._ensure_groups()
        return moved

    def rebalance(self, experts: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Decision | None:
        """Collective: applies the pending plan, if any; returns it."""
        decision, self.pending = self.pending, None
        if decision is None or not decision.primitives:
            return decision
        self.adjust(decision.primitives, experts, optimizer)
        self.history[-1]["applied"] = len(decision.primitives)
        return decision

    def first_slots(self) -> np.ndarray:
        """(E,) int64: the first global slot of each expert (where gather_experts reads it)."""
        return np.array([self.table.slots_of(e)[0] for e in range(self.table.num_experts)], dtype=np.int64)

    # -- replica groups --------------------------------------------------------------
    def _ensure_groups(self) -> None:
        """Collective: a communicator for every replica group of the table.
        Missing groups are split from the layer's communicator in rounds of
        disjoint groups (one split each), the same rounds on every rank."""
        needed = [ranks for _, ranks in self.table.replica_groups()]
        missing = sorted(set(needed) - set(self._groups))
        while missing:
            round_, taken, later = [], set(), []
            for ranks in missing:
                (later if taken & set(ranks) else round_).append(ranks)
                if round_ and round_[-1] == ranks:
                    taken |= set(ranks)
            mine = next((i for i, ranks in enumerate(round_) if self.comm.rank in ranks), None)
            made = self.comm.split(mine)
            for i, ranks in enumerate(round_):  # every rank keeps the same keys (None: not a member)
                self._groups[ranks] = made if i == mine else None
            missing = later
        for ranks in needed:
            self._groups.move_to_end(ranks)
        # Drop the least recently used groups the table does not need (same choice on every rank).
        for ranks in [r for r in self._groups if r not in set(needed)][: max(0, len(self._groups) - MAX_GROUPS)]:
            del self._groups[ranks]

