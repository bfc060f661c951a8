"""vExpert slots and their placement table (FlexMoE, Sections 3.2-3.3).

Every rank holds S vExpert slots; global slot p = w S + j is slot j of rank
w. The table is a (W, S) int64 array: the expert each slot serves, or FREE.
An expert may fill several slots, on one rank or on several (its replicas);
every replica holds the same parameters and optimizer state. The table is
the same on every rank and changes only through the primitives:

- ``Expand(expert, slot)``: a FREE slot becomes a replica of `expert`, its
  states copied from a slot that serves it (on the same rank when one does,
  else from the lowest such slot);
- ``Shrink(slot)``: the slot is FREE (a tag; its states are left as they
  are and no longer used). An expert's last slot cannot shrink;
- ``Migrate(slot_a, slot_b)``: the two slots swap their experts and states.

``n_{e,g}`` (:meth:`SlotTable.replicas`) is how many slots of rank g serve
expert e: the rank's share of e's tokens is proportional to it (Algorithm 3,
moe_runtime.flex.routing). :meth:`SlotTable.apply` applies primitives in
order and says where each slot's states come from
(:class:`Transfer`), which moe_runtime.experts.relocation.copy_slots carries out
in one exchange: copies with the same source and destination rank travel
in one message, and copies between different pairs at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["FREE", "Expand", "Migrate", "Primitive", "Shrink", "SlotTable", "Transfer"]

FREE = -1


@dataclass(frozen=True)
class Expand:
    """A FREE `slot` (global: rank * S + j) becomes a replica of `expert`."""

    expert: int
    slot: int


@dataclass(frozen=True)
class Shrink:
    """`slot` is released (FREE): a tag, no communication."""

    slot: int


@dataclass(frozen=True)
class Migrate:
    """Slots `slot_a` and `slot_b` swap their experts and states."""

    slot_a: int
    slot_b: int


Primitive = Expand | Shrink | Migrate


@dataclass(frozen=True)
class Transfer:
    """Where each slot's states come from after some primitives.

    ``source`` (W S,) int64: for slot p, the slot (before the primitives)
    whose states p must hold, or -1 where p keeps its own (unchanged, or
    FREE). Copies whose source is on another rank are sent point to point."""

    source: np.ndarray
    slots_per_rank: int

    def copies(self) -> np.ndarray:
        """(C, 2) int64: (destination slot, source slot) of every copy."""
        destinations = np.flatnonzero(self.source >= 0)
        return np.stack([destinations, self.source[destinations]], axis=1)

    def messages(self) -> dict[tuple[int, int], int]:
        """{(source rank, destination rank): slots sent}, one merged message
        per pair of different ranks (a source slot needed twice on one rank
        is sent once)."""
        pairs: dict[tuple[int, int], set[int]] = {}
        for destination, source in self.copies().tolist():
            src, dst = source // self.slots_per_rank, destination // self.slots_per_rank
            if src != dst:
                pairs.setdefault((src, dst), set()).add(source)
        return {pair: len(sources) for pair, sources in sorted(pairs.items())}

    @property
    def empty(self) -> bool:
        return not (self.source >= 0).any()


class SlotTable:
    """The (W, S) placement table of vExpert slots (immutable; see the module docstring)."""

    def __init__(self, slots: np.ndarray | Sequence[Sequence[int]], num_experts: int):
        array = np.array(slots, dtype=np.int64, copy=True)
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise ValueError(f"SlotTable: slots must be (ranks, slots per rank), got shape {array.shape}")
        if num_experts < 1:
            raise ValueError(f"SlotTable: num_experts must be positive, got {num_experts}")
        bad = array[(array != FREE) & ((array < 0) | (array >= num_experts))]
        if bad.size:
            raise ValueError(f"SlotTable: slots hold expert ids in [0, {num_experts}) or FREE ({FREE}), "
                             f"got {sorted(set(bad.tolist()))}")
        served = np.bincount(array[array != FREE], minlength=num_experts)
        if (served == 0).any():
            raise ValueError(f"SlotTable: every expert needs a slot; experts {np.flatnonzero(served == 0).tolist()} "
                             "have none")
        array.setflags(write=False)
        self.slots, self.num_experts = array, int(num_experts)

    @classmethod
    def round_robin(cls, num_experts: int, ranks: int, slots_per_rank: int) -> SlotTable:
        """Slot p holds expert p mod E: every slot used, experts replicated in turn."""
        if ranks * slots_per_rank < num_experts:
            raise ValueError(f"SlotTable: {ranks} ranks x {slots_per_rank} slots cannot hold {num_experts} experts")
        return cls(np.arange(ranks * slots_per_rank).reshape(ranks, slots_per_rank) % num_experts, num_experts)

    @classmethod
    def plain(cls, num_experts: int, ranks: int, slots_per_rank: int) -> SlotTable:
        """The plain layer's placement (rank w: experts [w n, (w + 1) n) in its
        first n slots, n = E / W) and the other slots FREE: no replica yet, so
        no replica gradient to all-reduce until the scheduler makes one."""
        if num_experts % ranks != 0 or slots_per_rank < num_experts // ranks:
            raise ValueError(f"SlotTable: the plain placement needs E = n W and S >= n, got E={num_experts}, "
                             f"W={ranks}, S={slots_per_rank}")
        slots = np.full((ranks, slots_per_rank), FREE, dtype=np.int64)
        slots[:, : num_experts // ranks] = np.arange(num_experts).reshape(ranks, -1)
        return cls(slots, num_experts)

    @property
    def ranks(self) -> int:
        return self.slots.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.slots.shape[1]

    def replicas(self) -> np.ndarray:
        """(E, W) int64: n_{e,g}, the slots of rank g serving expert e."""
        table = np.zeros((self.num_experts, self.ranks), dtype=np.int64)
        ranks, _ = np.nonzero(self.slots != FREE)
        np.add.at(table, (self.slots[self.slots != FREE], ranks), 1)
        return table

    def slots_of(self, expert: int) -> list[int]:
        """Global slots serving `expert`, ascending."""
        return np.flatnonzero(self.slots.reshape(-1) == expert).tolist()

    def ranks_of(self, expert: int) -> list[int]:
        """Ranks holding a replica of `expert`, ascending."""
        return sorted({slot // self.slots_per_rank for slot in self.slots_of(expert)})

    def replica_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """[(expert, ranks)] of every expert on more than one rank, by ascending
        expert id: the order of the gradient all-reduces (every rank issues the
        same sequence, Section 4 "AllReduce Coordination")."""
        groups = []
        for expert in range(self.num_experts):
            ranks = tuple(self.ranks_of(expert))
            if len(ranks) > 1:
                groups.append((expert, ranks))
        return groups

    def primary_slots(self, rank: int) -> np.ndarray:
        """(E,) int64: the first local slot j of `rank` serving each expert, -1
        where the rank has none. That slot computes all of the rank's rows of
        the expert; its other slots of the expert share its weights (the
        paper's packing of one GPU's vExperts of an expert)."""
        primary = np.full(self.num_experts, -1, dtype=np.int64)
        row = self.slots[rank]
        for j in range(row.size - 1, -1, -1):
            if row[j] != FREE:
                primary[row[j]] = j
        return primary

    def apply(self, primitives: Iterable[Primitive]) -> tuple[SlotTable, Transfer]:
        """The table after `primitives` (in order) and where each slot's
        states come from; a ValueError names the first primitive that cannot
        apply (nothing changes)."""
        slots = self.slots.reshape(-1).copy()
        content = np.arange(slots.size, dtype=np.int64)  # the original slot whose states p holds; -1: none
        per_rank = self.slots_per_rank
        for index, primitive in enumerate(primitives):
            where = f"primitive {index} ({primitive})"
            if isinstance(primitive, Shrink):
                slot = self._slot(primitive.slot, where)
                if slots[slot] == FREE:
                    raise ValueError(f"{where}: slot {slot} is FREE already")
                if (slots == slots[slot]).sum() == 1:
                    raise ValueError(f"{where}: slot {slot} is the last one serving expert {slots[slot]}")
                slots[slot], content[slot] = FREE, -1
            elif isinstance(primitive, Expand):
                slot = self._slot(primitive.slot, where)
                expert = primitive.expert
                if not 0 <= expert < self.num_experts:
                    raise ValueError(f"{where}: expert {expert} is not in [0, {self.num_experts})")
                if slots[slot] != FREE:
                    raise ValueError(f"{where}: slot {slot} serves expert {slots[slot]}; Shrink it first")
                serving = np.flatnonzero((slots == expert) & (content >= 0))
                local = serving[serving // per_rank == slot // per_rank]
                source = local[0] if local.size else serving[0]
                slots[slot], content[slot] = expert, content[source]
            elif isinstance(primitive, Migrate):
                a, b = self._slot(primitive.slot_a, where), self._slot(primitive.slot_b, where)
                slots[[a, b]], content[[a, b]] = slots[[b, a]], content[[b, a]]
            else:
                raise TypeError(f"{where}: not an Expand, Shrink or Migrate")
        moved = (content != np.arange(slots.size)) & (slots != FREE)
        source = np.where(moved, content, -1)
        return SlotTable(slots.reshape(self.slots.shape), self.num_experts), Transfer(source, per_rank)

    def _slot(self, slot: int, where: str) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots.size:
            raise ValueError(f"{where}: slot {slot!r} is not in [0, {self.slots.size}) "
                             f"({self.ranks} ranks x {self.slots_per_rank} slots)")
        return int(slot)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotTable) and other.num_experts == self.num_experts and \
            np.array_equal(other.slots, self.slots)

    def __hash__(self) -> int:
        return hash((self.num_experts, self.slots.tobytes()))

    def __repr__(self) -> str:
        return f"SlotTable({self.slots.tolist()}, num_experts={self.num_experts})"
