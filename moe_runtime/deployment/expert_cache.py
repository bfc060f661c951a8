"""Expert buffering (Deployment paper, Section VI): expert weights in host memory, a few device slots.

``weights`` maps a name to a tensor ``[E, ...]`` (expert e's slice at row e,
like FFNExperts' ``batched_fc1_w[e]``). They stay in host memory, page-locked
when ``device`` is CUDA so the copies run asynchronously; the device holds a
pool per name, ``[num_slots, ...]``. ``fetch(active)`` asks the policy core
(cache_policy.py) which slots the batch's experts take and copies the misses
in: on CUDA on a dedicated copy stream, with an event the current (compute)
stream waits on; on CPU with a plain ``copy_`` into the separate pool.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from .cache_policy import CacheStats, PolicyCore


class ExpertCache:
    """``num_slots`` device slots over E experts held on the host; ``policy`` in lifo/lru/fifo/belady.

    >>> cache = ExpertCache(2, weights={"fc1_w": torch.randn(4, 8, 4)})
    >>> slots = cache.fetch({1, 3})          # {1: 0, 3: 1}
    >>> w1 = cache.pool["fc1_w"][slots[1]]   # expert 1's fc1 weight, on the device

    Without ``weights`` the cache is unbound until :meth:`bind` (what
    ``MoELayer(expert_cache=ExpertCache(2))`` does with the layer's experts).
    ``record=True`` keeps every batch's active experts in ``recorded`` (a
    routing trace for ``cache_policy.simulate``).
    """

    def __init__(
        self,
        num_slots: int,
        policy: str = "lifo",
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        trace: Sequence[Iterable[int]] | None = None,
        record: bool = False,
    ):
        self.core = PolicyCore(num_slots, policy, trace=trace, keep_batch=True)
        self.recorded: list[frozenset[int]] | None = [] if record else None
        self.bytes_copied = 0
        self.num_experts = 0
        self.host: dict[str, torch.Tensor] = {}
        self.pool: dict[str, torch.Tensor] = {}
        self.bytes_per_expert = 0
        self.device = torch.device(device)
        if weights is not None:
            self.bind(weights, device)

    def bind(self, weights: Mapping[str, torch.Tensor], device: torch.device | str) -> None:
        """Takes a private host copy of ``weights`` (name -> ``[E, ...]``) and a
        pool on ``device``; any resident expert is forgotten (its slot held the
        old weights). Stats, recorded batches and belady's trace position stay."""
        if not weights:
            raise ValueError("weights is empty: give at least one tensor [E, ...]")
        counts = {name: w.shape[0] if w.dim() else 0 for name, w in weights.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"weights disagree on the number of experts (leading dim): {counts}")
        num_experts = next(iter(counts.values()))
        if num_experts < 1:
            raise ValueError(f"weights have no experts (leading dim {num_experts})")
        self.num_experts = num_experts
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.host = {}
        # Normal tensors even where the first call runs under torch.inference_mode(): a later call outside
        # it could not write inference tensors (the slots).
        with torch.inference_mode(False):
            for name, w in weights.items():
                w = w.detach().to("cpu").contiguous()
                self.host[name] = w.pin_memory() if self.on_cuda else w.clone()
            self.pool = {
                name: torch.empty((self.num_slots, *w.shape[1:]), dtype=w.dtype, device=self.device)
                for name, w in self.host.items()
            }
        self.bytes_per_expert = sum(w[0].numel() * w.element_size() for w in self.host.values())
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.core.forget_residents()

    @property
    def bound(self) -> bool:
        return bool(self.host)

    @property
    def num_slots(self) -> int:
        return self.core.num_slots

    @property
    def stats(self) -> CacheStats:
        return self.core.stats

    @property
    def memory_saved(self) -> int:
        """Device bytes not allocated: (E - num_slots) x bytes per expert (0 when every expert fits)."""
        return max(self.num_experts - self.num_slots, 0) * self.bytes_per_expert

    def report(self) -> dict[str, float]:
        """Hits, misses, miss rate, bytes copied and device bytes saved."""
        return {**self.stats.as_dict(), "bytes_copied": self.bytes_copied, "memory_saved": self.memory_saved}

    def _active(self, active_experts: Iterable[int]) -> set[int]:
        if not self.bound:
            raise RuntimeError("the expert cache has no weights yet: pass weights= or call bind()")
        active = set()
        for expert in active_experts:
            try:
                active.add(operator.index(expert))  # ints, NumPy and 0-d torch integers
            except TypeError:
                raise ValueError(f"expert id {expert!r} is not an integer") from None
        unknown = sorted(e for e in active if not 0 <= e < self.num_experts)
        if unknown:
            raise ValueError(f"expert ids {unknown} are unknown: the cache holds experts 0..{self.num_experts - 1}")
        return active

    def _access(self, active: set[int], keep_batch: bool) -> list:
        if self.recorded is not None:
            self.recorded.append(frozenset(active))
        return self.core.access_batch(active, keep_batch=keep_batch)

    def fetch(self, active_experts: Iterable[int]) -> dict[int, int]:
        """Makes every expert of this batch resident; returns {expert: slot} (weights at ``pool[name][slot]``)."""
        active = self._active(active_experts)
        if len(active) > self.num_slots:
            raise ValueError(
                f"batch {self.core.batch_index} needs {len(active)} experts resident at once "
                f"but the cache has num_slots={self.num_slots}; fetch_each() brings them in one at a time"
            )
        accesses = self._access(active, keep_batch=True)
        misses = [(a.expert, a.slot) for a in accesses if not a.hit]
        if misses:
            self._copy_in(misses)
        return {a.expert: a.slot for a in accesses}

    def fetch_each(self, active_experts: Iterable[int]) -> Iterator[tuple[int, int]]:
        """The batch's experts one at a time, in increasing id (the paper's
        serial execution): yields (expert, slot) once that expert is resident.
        The caller is done with an expert when it asks for the next, so an
        expert of this batch already yielded may be evicted: a batch may need
        more experts than there are slots."""
        accesses = self._access(self._active(active_experts), keep_batch=False)
        for access in accesses:
            if not access.hit:
                self._copy_in([(access.expert, access.slot)])
            yield access.expert, access.slot

    def _copy_in(self, misses: list[tuple[int, int]]) -> None:
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.device)
            # the slots may still be read by kernels queued on the compute stream
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                for expert, slot in misses:
                    for name, w in self.host.items():
                        self.pool[name][slot].copy_(w[expert], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
            compute.wait_event(done)
        else:
            for expert, slot in misses:
                for name, w in self.host.items():
                    self.pool[name][slot].copy_(w[expert])
        self.bytes_copied += len(misses) * self.bytes_per_expert
