"""The dictionary of best configurations: capacity window -> (r, d, algo) or a flow.

Tutel (Section 3.3) keeps, for each MoE layer, a map from ``floor(c / R)``
(``c`` the step's capacity, ``R`` the window, default 128) to the best
configuration measured for that range of capacities:

- ``r``, the parallelism degree: 0 is data parallel (no all-to-all), 1 .. s
  with s = ceil(W / E) run the experts EP+DP+MP (r = 1 is EP+DP, r = s is
  EP+MP). The layer says which r it can run (``valid_rs``).
- ``d``, the pipelining degree: the capacity is cut into d pieces whose
  all-to-alls and expert work overlap.
- ``algo``, the all-to-all algorithm: "linear", or "2dh" (two levels, only
  when the job has more than one node and more than one rank per node).

Those are the configurations of the expert-parallel flow, ``flow="expert"``.
A layer may offer other flows over the same expert parameters (``flows`` of
:meth:`AdaptiveDictionary.bind`; the layer's ``flows=``): "dropless",
"data_centric", "model_centric". Each has nothing to tune here and is one
configuration, :func:`flow_config` (its r, d and algo are placeholders).

Every configuration computes the same function, so the search runs on real
training steps: the layer asks :meth:`AdaptiveDictionary.choose` what to run,
runs it and gives the step's time to :meth:`AdaptiveDictionary.report`.
Nothing here communicates. The layer hands every rank the same numbers (the
capacity agreed across ranks, the step time as its maximum over ranks), and
every decision is a function of those numbers only, so every rank decides the
same thing at every step.

The state machine of one key
----------------------------
::

    untuned --choose()--> tuning --last trial--> tuned --drift--> tuning ...

untuned
    No entry. The first :meth:`choose` of the key starts a search.
tuning
    A search runs: a generator that yields the configuration of its next
    trial and is sent that trial's time. :meth:`choose` returns that
    configuration. Of the reports for it, the first ``warmup`` are dropped
    (allocator and cache effects of a switch) and the median of the next
    ``repeats`` is the trial's time; the search is sent that and yields the
    next trial or ends. Reports of any other configuration (a step the user
    forced) do not count. When the search ends its best configuration
    becomes the key's entry, and the file is saved.
tuned
    :meth:`choose` returns the entry's configuration. Drift: the reports of
    that configuration are watched; when the median of the last ``repeats``
    of them differs from the entry's time by more than ``drift`` times that
    time (slower or faster), the key is searched again from scratch. The old
    entry serves in :attr:`entries` until the new search replaces it.

The search
----------
r = 0 and r = s are measured once each. Over the valid r strictly between 0
and s (sorted; they need not be contiguous) the cost of r, the minimum over
its (d, algo) trials, is taken to be unimodal (Tutel: convex), and the
search is a ternary search in its Fibonacci form: the interval of indices
has a Fibonacci length F(k), the two probes sit at F(k-2) and F(k-1) from
its left end, and the side beyond the worse probe is dropped. The interval
left, of length F(k-1), holds the other probe exactly where the next step
wants one, so after the first step each step measures one new r and the
interval shrinks by a factor F(k-1) / F(k) <= 2/3. (Plain ternary search at
thirds would measure two new r per step.) Indices past the end are padding
of infinite cost and are never measured. Measuring an r runs one trial for
every pipelining degree and every allowed algorithm, except r = 0, which
has no all-to-all and is one trial, reported as ``Config(0, 1, "linear")``.
Then each other flow the layer offers is measured once, in the order of
``FLOWS``. No configuration is measured twice. The entry is the fastest
trial of all, whatever its flow. Trials per key are at most
``(log_{3/2}(s) + 2) * len(degrees) * len(allowed algos) + len(flows)``
(``tests/unit/test_runtime_tuner.py`` checks it over many s and sets of
valid r).

The prior
---------
With ``prior`` (e.g. :class:`moe_runtime.tuning.prior.ExchangePrior`, the exchange
time the scale model :mod:`a2a.sim` predicts), a search starts by asking it
for every configuration of every r > 0 at the key's capacity, and leaves out
the (d, algo) of an r predicted more than ``prior_factor`` times slower than
the best predicted (d, algo) of the same r; those are never tried. The best
predicted of each r always is, so every r still has a cost and the search over
r is unchanged. Predictions are compared only within an r because the prior
sees the exchanges alone: the expert compute and the weight gathers differ
between r but not between the (d, algo) of one r. A configuration the prior
has no opinion of (None: r = 0) is never left out. The default factor, 4,
is wide because a pipelined step hides part of its exchange behind compute:
a larger d that exchanges more can still win. :meth:`skipped` says how many
trials the prior saved at a key: the configurations it left out of the r the
search measured.

Persistence
-----------
With ``path``, the file is read at construction (a missing file is an empty
dictionary; one that is not this format is a ValueError naming it) and
written whenever a key finishes tuning, by the rank that :meth:`bind` named
the writer, as a temporary file renamed over the old one. It is JSON::

    {"format": "moe_runtime.tuning.dictionary", "version": 2,
     "tables": {"<table name>": {"<key>": {"r": 2, "d": 4, "algo": "linear",
                                          "flow": "expert", "seconds": 0.0123,
                                          "trials": 14}}}}

A table name is the canonical JSON (sorted keys, no spaces) of the layer's
signature, the window and the search space (valid r, degrees, allowed
algorithms, and the other flows when there are any): tables of other layers,
shapes or machines stay in the file and are not used. Version 1 files (no
"flow": every entry is the expert flow's) still load. Saving merges with what the file holds by then, so layers with
their own dictionaries can share one file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import os
import statistics
import tempfile
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["ALGOS", "DATA_PARALLEL", "FLOWS", "SOLO_FLOWS", "AdaptiveDictionary", "Config", "Entry", "flow_config"]

ALGOS = ("linear", "2dh")
# "expert": Tutel's flows of (r, d, algo); the others are one configuration each (the layer's flows=).
FLOWS = ("expert", "dropless", "data_centric", "model_centric")
# Flows that only run alone, never as the dictionary's choice: named so that every call's
# configuration is a Config (one configuration each, as the other flows).
SOLO_FLOWS = ("dynamic", "flex")
FILE_FORMAT = "moe_runtime.tuning.dictionary"
FILE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no "flow" (every entry the expert flow's)
_PLACEHOLDER = (0, 1, "linear")  # (r, d, algo) of a flow other than "expert"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """How to run one step: the expert-parallel flow (``flow="expert"``)
    with parallelism degree ``r`` (0 = data parallel), pipelining degree
    ``d``, all-to-all algorithm ``algo`` ("linear" or "2dh"); or another
    flow of ``FLOWS``, one configuration each (:func:`flow_config`: r, d and
    algo are the placeholders 0, 1, "linear")."""

    r: int
    d: int
    algo: str
    flow: str = "expert"

    def __post_init__(self) -> None:
        if self.flow not in FLOWS + SOLO_FLOWS:
            raise ValueError(f"unknown flow {self.flow!r}; the flows are {FLOWS + SOLO_FLOWS}")
        if self.flow != "expert" and (self.r, self.d, self.algo) != _PLACEHOLDER:
            raise ValueError(f"flow {self.flow!r} has no r, d or algo to choose: its configuration is "
                             f"flow_config({self.flow!r}) (r=0, d=1, 'linear'), got r={self.r}, d={self.d}, "
                             f"{self.algo!r}")

    def __str__(self) -> str:
        return f"r={self.r} d={self.d} {self.algo}" if self.flow == "expert" else self.flow


def flow_config(flow: str) -> Config:
    """The one configuration of a flow other than "expert"."""
    if flow == "expert":
        raise ValueError("the expert flow has many configurations (r, d, algo); give them: Config(r, d, algo)")
    return Config(*_PLACEHOLDER, flow)


DATA_PARALLEL = Config(0, 1, "linear")
"""r = 0 runs no all-to-all, so it is one configuration, reported as d = 1, "linear"."""


@dataclass(frozen=True)
class Entry:
    """The result of a key's search: the fastest configuration, its step time
    (seconds, the median over ``repeats`` steps), and how many trials the search ran."""

    config: Config
    seconds: float
    trials: int


@dataclass(frozen=True)
class _Space:
    """What a search may try: the valid r (sorted, with 0), the pipelining
    degrees, the algorithms the layer allows, its other flows (in FLOWS' order)."""

    valid_rs: tuple[int, ...]
    degrees: tuple[int, ...]
    algos: tuple[str, ...]
    flows: tuple[str, ...] = ()
    skip: frozenset[Config] = frozenset()  # left out by the prior

    def configs_of(self, r: int) -> list[Config]:
        """Every configuration of r."""
        if r == 0:
            return [DATA_PARALLEL]
        return [Config(r, d, algo) for d in self.degrees for algo in self.algos]

    def trials_of(self, r: int) -> list[Config]:
        """The trials that measure r: its configurations less those the prior left out."""
        return [config for config in self.configs_of(r) if config not in self.skip]

    def __contains__(self, config: Config) -> bool:
        if config.flow != "expert":
            return config.flow in self.flows
        return config.r in self.valid_rs and config in self.configs_of(config.r)


_Steps = Generator[Config, float, Any]  # yields a trial's config, is sent its seconds


def _search(space: _Space) -> Generator[Config, float, tuple[Config, float]]:
    """One key's search (see the module docstring); returns the fastest trial."""
    cost_of: dict[int, float] = {}
    best: list[tuple[float, Config]] = []  # the fastest trial so far; the first one wins a tie

    def trial(config: Config) -> Generator[Config, float, float]:
        seconds = yield config
        if not best or seconds < best[0][0]:
            best[:] = [(seconds, config)]
        return seconds

    def measure(r: int) -> Generator[Config, float, float]:
        if r not in cost_of:
            cost = math.inf
            for config in space.trials_of(r):
                cost = min(cost, (yield from trial(config)))
            cost_of[r] = cost
        return cost_of[r]

    s = space.valid_rs[-1]
    yield from measure(0)
    if s > 0:
        yield from measure(s)
    yield from _fibonacci_search([r for r in space.valid_rs if 0 < r < s], measure)
    for flow in space.flows:
        yield from trial(flow_config(flow))
    seconds, config = best[0]
    return config, seconds


def _fibonacci_search(points: Sequence[int], measure: Callable[[int], _Steps]) -> _Steps:
    """Measure enough of `points` to find the one of least cost, for a cost
    unimodal over them; `measure` memoizes."""

    def cost(index: int) -> _Steps:
        if index >= len(points):
            return math.inf  # padding up to the Fibonacci length
        return (yield from measure(points[index]))

    fib = [1, 1]  # F(1), F(2), ...: fib[j] is F(j + 1)
    while fib[-1] < len(points) + 1:
        fib.append(fib[-1] + fib[-2])
    # The candidates are the indices strictly between lo and lo + fib[k].
    k, lo = len(fib) - 1, -1
    while k >= 3:
        left, right = lo + fib[k - 2], lo + fib[k - 1]
        if (yield from cost(left)) > (yield from cost(right)):
            lo = left
        # Else the candidates end before `right`. A tie goes there too: a convex cost has its
        # minimum between two equal probes, which both sides keep, and ties of padding must go left.
        k -= 1
    if points:
        yield from cost(lo + 1)  # the one candidate left; already measured unless there was one point


class _Tuning:
    """A running search at one key: turns reports into trial times for it."""

    def __init__(self, space: _Space, warmup: int, repeats: int):
        self._space = space
        self._measured_rs: set[int] = set()
        self._steps = _search(space)
        self._warmup, self._repeats = warmup, repeats
        self._times: list[float] = []
        self.trials = 0  # trials finished
        self.config = next(self._steps)  # the trial running now

    def report(self, config: Config, seconds: float) -> tuple[Config, float] | None:
        """Count a step; the search's result when this step ended it."""
        if config != self.config:
            return None
        self._times.append(seconds)
        if len(self._times) < self._warmup + self._repeats:
            return None
        trial_seconds = statistics.median(self._times[self._warmup :])
        self._times.clear()
        self.trials += 1
        if config.flow == "expert":
            self._measured_rs.add(config.r)
        try:
            self.config = self._steps.send(trial_seconds)
        except StopIteration as done:
            return done.value
        return None

    @property
    def skipped(self) -> int:
        """Trials the prior saved so far: the left-out configurations of the r measured."""
        return sum(1 for config in self._space.skip if config.r in self._measured_rs)


class _Table:
    """What the dictionary holds for one table name: entries, running searches,
    the drift windows of tuned keys, and whether it has news for the file."""

    def __init__(self, entries: dict[int, Entry] | None = None):
        self.entries: dict[int, Entry] = dict(entries or {})
        self.tunings: dict[int, _Tuning] = {}
        self.recent: dict[int, deque[float]] = {}
        self.skipped: dict[int, int] = {}  # key -> trials the prior saved in its last search
        self.changed = False


@dataclass(frozen=True)
class _Binding:
    signature: Mapping[str, Any]
    space: _Space
    table: str
    writer: bool


class AdaptiveDictionary:
    """Per-capacity-window best (r, d, algo), or other flow, of one MoE layer,
    found online by running trial configurations on real steps (Tutel,
    Section 3.3).

    Args:
        window: capacities c with the same ``c // window`` share an entry.
        degrees: the pipelining degrees to try, in order.
        algos: the all-to-all algorithms to try, of "linear" and "2dh" ("2dh"
            only where :meth:`bind` says the layer is two-level).
        warmup: reports dropped at the start of every trial.
        repeats: reports whose median is a trial's time; also the length of
            the drift window.
        path: JSON file to load at construction and save to when a key is
            tuned (see the module docstring); None keeps everything in memory.
        drift: a tuned key is searched again when the median of its last
            ``repeats`` reports differs from its entry's time by more than this
            fraction of it; ``math.inf`` never searches again.
        prior: ``prior(signature, capacity, config) -> seconds or None``,
            the predicted cost of a configuration (the exchange time of
            :class:`moe_runtime.tuning.prior.ExchangePrior`); None: no prior. See the
            module docstring.
        prior_factor: (d, algo) of an r predicted more than this many times
            slower than the best predicted of that r are not tried (> 1).

    Use: :meth:`bind` once (and again for another signature), then every
    step :meth:`choose` and :meth:`report`.
    """

    def __init__(self, window: int = 128, degrees: Sequence[int] = (1, 2, 4, 8),
                 algos: Sequence[str] = ALGOS, warmup: int = 1, repeats: int = 3,
                 path: str | os.PathLike[str] | None = None, drift: float = 0.25,
                 prior: Callable[[Mapping[str, Any], int, Config], float | None] | None = None,
                 prior_factor: float = 4.0):
        self._window = _as_int("window", window, 1)
        self._degrees = _unique("degrees", [_as_int("degrees", d, 1) for d in _sequence("degrees", degrees)])
        names = _unique("algos", list(_sequence("algos", algos)))
        for name in names:
            if name not in ALGOS:
                raise ValueError(f"algos: unknown algorithm {name!r}; the algorithms are {ALGOS}")
        self._algos = names
        self._warmup = _as_int("warmup", warmup, 0)
        self._repeats = _as_int("repeats", repeats, 1)
        drift = float(drift)
        if not drift > 0:
            raise ValueError(f"drift must be > 0 (a fraction of the recorded time; math.inf: never), got {drift}")
        self._drift = drift
        if prior is not None and not callable(prior):
            raise TypeError(f"prior must be callable (signature, capacity, config) -> seconds, got "
                            f"{type(prior).__name__}")
        prior_factor = float(prior_factor)
        if not prior_factor > 1:
            raise ValueError(f"prior_factor must be > 1 (how many times slower than the best prediction), "
                             f"got {prior_factor}")
        self._prior, self._prior_factor = prior, prior_factor
        self._path = None if path is None else os.fspath(path)
        self._tables: dict[str, _Table] = {}
        self._binding: _Binding | None = None
        if self._path is not None and os.path.exists(self._path):
            for name, entries in _read_file(self._path).items():
                self._tables[name] = _Table(entries)

    # -- the layer's side ------------------------------------------------------------------------

    def bind(self, signature: Mapping[str, Any], valid_rs: Sequence[int], two_level: bool, *,
             writer: bool = True, flows: Sequence[str] = ()) -> None:
        """Say which layer and machine the coming steps are for.

        Args:
            signature: JSON-able description of everything that changes the
                answer (world size, local size, nodes, E, M, H, k, dtype,
                device, ...); opaque here, part of the table name.
            valid_rs: the r the layer can run: non-negative, with 0; the
                largest is s.
            two_level: whether "2dh" can run (more than one node and more than
                one rank per node).
            writer: whether this rank writes the file (``rank == 0``).
            flows: the layer's other flows, of "dropless", "data_centric",
                "model_centric" (each computing what the expert flow does);
                each is one trial of every search.

        Binding another signature switches tables; the searches of the one
        left resume when it is bound again.
        """
        if not isinstance(signature, Mapping):
            raise TypeError(f"signature must be a dict, got {type(signature).__name__}")
        rs = sorted({_as_int("valid_rs", r, 0) for r in _sequence("valid_rs", valid_rs)})
        if not rs or rs[0] != 0:
            raise ValueError(f"valid_rs must include 0 (data parallel), got {list(valid_rs)}")
        algos = tuple(a for a in self._algos if a != "2dh" or two_level)
        if rs[-1] > 0 and not algos:
            raise ValueError(f"no algorithm to try: algos={self._algos} and the layer is not two-level")
        given = _sequence("flows", flows)
        for flow in given:
            if flow not in FLOWS[1:]:
                raise ValueError(f"flows: unknown flow {flow!r}; the other flows are {FLOWS[1:]} (the expert flow "
                                 "is always searched)")
        if len(set(given)) != len(given):
            raise ValueError(f"flows has duplicates: {list(given)}")
        others = tuple(flow for flow in FLOWS[1:] if flow in given)
        space = _Space(tuple(rs), self._degrees, algos, others)
        described = {"signature": signature, "window": self._window, "valid_rs": rs,
                     "degrees": list(self._degrees), "algos": list(algos)}
        if others:  # absent otherwise: the tables of layers without flows keep their names
            described["flows"] = list(others)
        try:
            table = json.dumps(described, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"signature must be JSON-able: {error}") from None
        for key, entry in self._tables.setdefault(table, _Table()).entries.items():
            if entry.config not in space:
                raise ValueError(f"{self._path or 'loaded JSON'}: entry {key} ({entry.config}) is not in "
                                 f"the search space of table {table}")
        self._binding = _Binding(dict(signature), space, table, bool(writer))

    def choose(self, capacity: int) -> Config:
        """The configuration to run this step at `capacity` (rows per expert,
        agreed across ranks): the key's current trial while it is tuning, else
        its entry; the first call for a key starts its search."""
        table, key = self._table(), self._key(capacity)
        tuning = table.tunings.get(key)
        if tuning is None:
            entry = table.entries.get(key)
            if entry is not None:
                return entry.config
            tuning = table.tunings[key] = self._start(table, key, capacity)
            _log.info("tuner: tuning capacities %s", self._range(key))
        return tuning.config

    def report(self, capacity: int, config: Config, seconds: float) -> None:
        """The time of the step that ran `config` at `capacity`: forward and
        backward, the maximum over ranks. A config other than the one
        :meth:`choose` gave counts for nothing."""
        table, key = self._table(), self._key(capacity)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a Config, got {type(config).__name__}")
        seconds = float(seconds)
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        tuning = table.tunings.get(key)
        if tuning is not None:
            result = tuning.report(config, seconds)
            if result is not None:
                table.skipped[key] = tuning.skipped
                self._finish(table, key, Entry(result[0], result[1], tuning.trials))
            return
        entry = table.entries.get(key)
        if entry is None or config != entry.config:
            return
        recent = table.recent.setdefault(key, deque(maxlen=self._repeats))
        recent.append(seconds)
        if len(recent) == self._repeats:
            now = statistics.median(recent)
            if abs(now - entry.seconds) > self._drift * entry.seconds:
                _log.info("tuner: capacities %s drifted (%s: %.6g s, recorded %.6g s); tuning again",
                          self._range(key), entry.config, now, entry.seconds)
                del table.recent[key]
                table.tunings[key] = self._start(table, key, capacity)

    # -- introspection ---------------------------------------------------------------------------

    @property
    def entries(self) -> Mapping[int, Entry]:
        """Key (``capacity // window``) -> :class:`Entry`, for the bound table (read-only copy)."""
        return MappingProxyType(dict(self._table().entries))

    def trials(self, capacity: int) -> int:
        """Trials of the key's search: those finished so far while it tunes,
        else those its entry took; 0 for a key never tuned."""
        table, key = self._table(), self._key(capacity)
        if key in table.tunings:
            return table.tunings[key].trials
        entry = table.entries.get(key)
        return 0 if entry is None else entry.trials

    def skipped(self, capacity: int) -> int:
        """Trials the prior saved at the key: the configurations it left out of
        the r that the search measured (so far, while it tunes; 0 without a
        prior, or for a key never searched here)."""
        table, key = self._table(), self._key(capacity)
        if key in table.tunings:
            return table.tunings[key].skipped
        return table.skipped.get(key, 0)

    def tuning(self, capacity: int) -> bool:
        """Whether the key of `capacity` has a search running."""
        table, key = self._table(), self._key(capacity)
        return key in table.tunings

    # -- persistence -----------------------------------------------------------------------------

    def to_json(self) -> str:
        """Every table's entries in the file format (running searches are not kept)."""
        return _dump({name: table.entries for name, table in self._tables.items()})

    @classmethod
    def from_json(cls, text: str, **options: Any) -> AdaptiveDictionary:
        """A dictionary with the entries of `text` (from :meth:`to_json` or a
        file); `options` go to the constructor, and `text` wins over the file
        of ``path`` for a table both hold."""
        dictionary = cls(**options)
        for name, entries in _parse(text, "JSON text").items():
            dictionary._tables[name] = _Table(entries)
        return dictionary

    def __repr__(self) -> str:
        head = (f"AdaptiveDictionary(window={self._window}, degrees={self._degrees}, algos={self._algos}, "
                f"warmup={self._warmup}, repeats={self._repeats}, drift={self._drift}, path={self._path!r}"
                + (f", prior={self._prior!r}, prior_factor={self._prior_factor}" if self._prior else "") + ")")
        if self._binding is None:
            return head + " (not bound)"
        binding, table = self._binding, self._tables[self._binding.table]
        space = binding.space
        lines = [head, f"  signature {json.dumps(binding.signature, sort_keys=True)}, valid r {space.valid_rs}, "
                       + f"algos {space.algos}" + (f", flows {space.flows}" if space.flows else "")]
        for key in sorted(set(table.entries) | set(table.tunings)):
            entry, tuning = table.entries.get(key), table.tunings.get(key)
            line = f"  c in {self._range(key)}:"
            if entry is not None:
                line += f" {entry.config}, {entry.seconds:.6g} s, {entry.trials} trials"
            if tuning is not None:
                line += f" tuning, trial {tuning.trials + 1} runs {tuning.config}"
            lines.append(line)
        return "\n".join(lines)

    # -- inside ----------------------------------------------------------------------------------

    def _table(self) -> _Table:
        if self._binding is None:
            raise RuntimeError("AdaptiveDictionary: call bind(signature, valid_rs, two_level) first")
        return self._tables[self._binding.table]

    def _key(self, capacity: int) -> int:
        return _as_int("capacity", capacity, 0) // self._window

    def _range(self, key: int) -> str:
        return f"[{key * self._window}, {(key + 1) * self._window})"

    def _start(self, table: _Table, key: int, capacity: int) -> _Tuning:
        assert self._binding is not None
        space = self._binding.space
        if self._prior is not None:
            space = dataclasses.replace(space, skip=self._pruned(space, capacity))
            if space.skip:
                _log.info("tuner: the prior leaves out %s at capacity %d", ", ".join(map(str, sorted(
                    space.skip, key=str))), capacity)
        return _Tuning(space, self._warmup, self._repeats)

    def _pruned(self, space: _Space, capacity: int) -> frozenset[Config]:
        """The configurations of each r > 0 predicted more than prior_factor times slower
        than the best predicted one of the same r."""
        assert self._binding is not None and self._prior is not None
        skip = set()
        for r in space.valid_rs:
            if r == 0:
                continue
            predicted = {}
            for config in space.configs_of(r):
                seconds = self._prior(self._binding.signature, capacity, config)
                if seconds is not None:
                    seconds = float(seconds)
                    if not (seconds >= 0 and math.isfinite(seconds)):
                        raise ValueError(f"prior: predicted {seconds} s for {config}; expected finite and >= 0")
                    predicted[config] = seconds
            if predicted:
                best = min(predicted.values())
                skip.update(c for c, seconds in predicted.items() if seconds > self._prior_factor * best)
        return frozenset(skip)

    def _finish(self, table: _Table, key: int, entry: Entry) -> None:
        del table.tunings[key]
        table.entries[key] = entry
        table.recent.pop(key, None)
        table.changed = True
        _log.info("tuner: capacities %s -> %s, %.6g s, after %d trials", self._range(key), entry.config,
                  entry.seconds, entry.trials)
        assert self._binding is not None
        if self._path is not None and self._binding.writer:
            self._save(self._path)

    def _save(self, path: str) -> None:
        """Write the tables into `path`: the ones tuned here over what the file
        holds now, the file's over the others loaded here."""
        tables = {name: table.entries for name, table in self._tables.items() if not table.changed}
        if os.path.exists(path):
            tables.update(_read_file(path))
        tables.update({name: table.entries for name, table in self._tables.items() if table.changed})
        folder = os.path.dirname(os.path.abspath(path))
        handle, temporary = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(_dump(tables))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise


def _as_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _sequence(name: str, value: Any) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a sequence (list or tuple), got {type(value).__name__} {value!r}")
    return value


def _unique(name: str, values: list[Any]) -> tuple[Any, ...]:
    if not values:
        raise ValueError(f"{name} must not be empty")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has duplicates: {values}")
    return tuple(values)


def _dump(tables: Mapping[str, Mapping[int, Entry]]) -> str:
    return json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "tables": {
        name: {str(key): {"r": e.config.r, "d": e.config.d, "algo": e.config.algo, "flow": e.config.flow,
                          "seconds": e.seconds, "trials": e.trials} for key, e in sorted(entries.items())}
        for name, entries in sorted(tables.items())}}, indent=1) + "\n"


def _read_file(path: str) -> dict[str, dict[int, Entry]]:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a {FILE_FORMAT} file (not UTF-8 text: {error})") from None
    return _parse(text, path)


def _parse(text: str, origin: str) -> dict[str, dict[int, Entry]]:
    """The tables of a document in the file format; ValueError naming `origin` otherwise."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{origin}: not a {FILE_FORMAT} file (not JSON: {error})") from None
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{origin}: not a {FILE_FORMAT} file (format {found!r})")
    if document.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{origin}: {FILE_FORMAT} version {document.get('version')!r}; "
                         f"this reader knows versions {READABLE_VERSIONS}")
    tables = document.get("tables")
    if not isinstance(tables, dict):
        raise ValueError(f"{origin}: 'tables' must be an object")  # noqa: TRY004 (a malformed file)
    parsed: dict[str, dict[int, Entry]] = {}
    for name, entries in tables.items():
        if not isinstance(entries, dict):
            raise ValueError(f"{origin}: table {name} must be an object")  # noqa: TRY004 (a malformed file)
        parsed[name] = {}
        for key, fields in entries.items():
            try:
                number = _parse_key(key)
                parsed[name][number] = _parse_entry(fields)
            except ValueError as error:
                raise ValueError(f"{origin}: entry {key!r} of table {name}: {error}") from None
    return parsed


def _parse_key(key: str) -> int:
    if not key.isdigit():
        raise ValueError("a key is a non-negative integer")
    return int(key)


def _parse_entry(fields: Any) -> Entry:
    names = {"r", "d", "algo", "seconds", "trials"}
    if not isinstance(fields, dict) or set(fields) - {"flow"} != names:
        raise ValueError('expected an object with "r", "d", "algo", "seconds", "trials" (and "flow")')
    r, d, algo, seconds, trials = (fields[name] for name in ("r", "d", "algo", "seconds", "trials"))
    flow = fields.get("flow", "expert")  # absent in version 1
    ints = (r, d, trials)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in ints) or r < 0 or d < 1 or trials < 0:
        raise ValueError(f"r >= 0, d >= 1 and trials >= 0 must be ints, got {r!r}, {d!r}, {trials!r}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
    return Entry(Config(r, d, algo, flow), float(seconds), trials)
