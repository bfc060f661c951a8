"""Eviction policies of the expert cache, without tensors (Deployment paper, Section VI).

A trace is a list of batches, each the set of expert ids active in it
(received count > 0). Within a batch the experts run serially in increasing
id order (the paper's premise), so a batch is a sequence of requests
``sorted(active)``: a request for a resident expert is a hit; otherwise a
miss, which takes a free slot or evicts a resident expert.

Victim on a miss with every slot taken:

- ``lifo`` (the paper): residents inactive in this batch first; among the
  candidates, the one inserted last. E = 4, 2 slots, batch (1, 2, 3): 1 and
  2 fill the cache, both are active, so 2 (inserted last) makes room for 3
  and 1, needed first by the next batch, stays.
- ``lru``: inactive first, then the one used longest ago.
- ``fifo``: inactive first, then the one inserted first.
- ``belady``: Belady's MIN on the flattened request stream, given the whole
  trace: the resident whose next request is furthest away (never again =
  infinitely far; ties to the smallest id). No inactive-first rule: MIN is
  optimal over every policy on the same stream, so it is the lower bound.
  With ``keep_batch=True`` (the storage, which needs all of a batch's
  experts resident at once) experts already requested in this batch are
  not candidates; MIN is then optimal only among such policies.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

POLICIES = ("lifo", "lru", "fifo", "belady")


@dataclass
class CacheStats:
    """Counts of a cache run; ``miss_rate`` is misses over requests."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def miss_rate(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "miss_rate": self.miss_rate,
        }


@dataclass(frozen=True)
class Access:
    """One request: ``expert`` in ``slot``; ``evicted`` the expert it replaced (or None)."""

    expert: int
    slot: int
    hit: bool
    evicted: int | None


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; the policies are {', '.join(POLICIES)}")


class PolicyCore:
    """Which expert sits in which slot, and which to evict, for a stream of batches."""

    def __init__(
        self,
        num_slots: int,
        policy: str = "lifo",
        trace: Sequence[Iterable[int]] | None = None,
        keep_batch: bool = False,
    ):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r}: the cache needs at least 1 slot")
        _check_policy(policy)
        self.num_slots, self.policy, self.keep_batch = num_slots, policy, keep_batch
        self.slot_of: dict[int, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.inserted: dict[int, int] = {}
        self.used: dict[int, int] = {}
        self.clock = 0
        self.batch_index = 0
        self.stats = CacheStats()
        self.future: dict[int, list[int]] = {}
        self.trace: list[set[int]] = []
        if policy == "belady":
            if trace is None:
                raise ValueError("policy='belady' needs the whole future trace (trace=...)")
            self.trace = [set(batch) for batch in trace]
            position = 0
            for batch in self.trace:
                for expert in sorted(set(batch)):
                    self.future.setdefault(expert, []).append(position)
                    position += 1

    def _next_use(self, expert: int) -> float:
        uses = self.future.get(expert, [])
        i = bisect.bisect_right(uses, self.clock - 1)  # the current request sits at position clock - 1
        return uses[i] if i < len(uses) else float("inf")

    def _victim(self, batch: set[int], requested: set[int], keep_batch: bool) -> int:
        residents = list(self.slot_of)
        if self.policy == "belady":
            candidates = [e for e in residents if e not in requested] if keep_batch else residents
            return max(candidates, key=lambda e: (self._next_use(e), -e))
        inactive = [e for e in residents if e not in batch]
        candidates = inactive or residents
        if self.policy == "lifo":
            return max(candidates, key=lambda e: self.inserted[e])
        if self.policy == "fifo":
            return min(candidates, key=lambda e: self.inserted[e])
        return min(candidates, key=lambda e: self.used[e])  # lru

    def forget_residents(self) -> None:
        """Empties every slot (their contents are stale, e.g. the weights changed); stats and the trace position stay."""
        self.slot_of.clear()
        self.inserted.clear()
        self.used.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))

    def access_batch(self, active: Iterable[int], keep_batch: bool | None = None) -> list[Access]:
        """Requests ``sorted(active)`` one by one; returns what happened to each.
        ``keep_batch`` overrides the core's setting for this batch (False: an
        expert already requested in the batch may be evicted, for a caller
        that uses each expert before requesting the next)."""
        keep_batch = self.keep_batch if keep_batch is None else keep_batch
        batch = set(active)
        if self.policy == "belady":
            # MIN's choices are only right for the trace it was given
            expected = self.trace[self.batch_index] if self.batch_index < len(self.trace) else None
            if batch != expected:
                raise ValueError(
                    f"batch {self.batch_index} is {sorted(batch)} but belady's trace has "
                    + (f"{sorted(expected)} there" if expected is not None else f"only {len(self.trace)} batches")
                )
        accesses: list[Access] = []
        requested: set[int] = set()
        for expert in sorted(batch):
            self.clock += 1
            self.stats.requests += 1
            evicted = None
            if expert in self.slot_of:
                self.stats.hits += 1
                hit = True
            else:
                self.stats.misses += 1
                hit = False
                if not self.free:
                    evicted = self._victim(batch, requested, keep_batch)
                    self.free.append(self.slot_of.pop(evicted))
                    self.inserted.pop(evicted)
                    self.used.pop(evicted)
                    self.stats.evictions += 1
                self.slot_of[expert] = self.free.pop()
                self.inserted[expert] = self.clock
            self.used[expert] = self.clock
            requested.add(expert)
            accesses.append(Access(expert, self.slot_of[expert], hit, evicted))
        self.batch_index += 1
        return accesses


def simulate(trace: Sequence[Iterable[int]], num_slots: int, policy: str = "lifo") -> CacheStats:
    """Runs ``policy`` with ``num_slots`` slots over ``trace`` (sets of active experts per batch)."""
    trace = [set(batch) for batch in trace]
    core = PolicyCore(num_slots, policy, trace=trace)
    for batch in trace:
        core.access_batch(batch)
    return core.stats
