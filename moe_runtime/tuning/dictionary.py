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

The search over r is moe_runtime.tuning.search; the file, moe_runtime.tuning.store.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import os
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .config import ALGOS, DATA_PARALLEL, FLOWS, SOLO_FLOWS, Config, Entry, flow_config
from .search import Space, Tuning
from .store import dump, parse, read_file, save

__all__ = ["ALGOS", "DATA_PARALLEL", "FLOWS", "SOLO_FLOWS", "AdaptiveDictionary", "Config", "Entry", "flow_config"]

_log = logging.getLogger(__name__)


class _Table:
    """What the dictionary holds for one table name: entries, running searches,
    the drift windows of tuned keys, and whether it has news for the file."""

    def __init__(self, entries: dict[int, Entry] | None = None):
        self.entries: dict[int, Entry] = dict(entries or {})
        self.tunings: dict[int, Tuning] = {}
        self.recent: dict[int, deque[float]] = {}
        self.skipped: dict[int, int] = {}  # key -> trials the prior saved in its last search
        self.changed = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _Table:
        """What was found, copied; a search still running (a generator, which cannot be copied) starts
        again in the copy at its key's next step (copy.deepcopy of a layer, moe_runtime.layer)."""
        copied = _Table(self.entries)
        copied.recent = {key: deque(window, maxlen=window.maxlen) for key, window in self.recent.items()}
        copied.skipped, copied.changed = dict(self.skipped), self.changed
        return copied


@dataclass(frozen=True)
class _Binding:
    signature: Mapping[str, Any]
    space: Space
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
            tuned (moe_runtime.tuning.store has the format); None keeps everything in memory.
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
            for name, entries in read_file(self._path).items():
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
        space = Space(tuple(rs), self._degrees, algos, others)
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
        return dump({name: table.entries for name, table in self._tables.items()})

    @classmethod
    def from_json(cls, text: str, **options: Any) -> AdaptiveDictionary:
        """A dictionary with the entries of `text` (from :meth:`to_json` or a
        file); `options` go to the constructor, and `text` wins over the file
        of ``path`` for a table both hold."""
        dictionary = cls(**options)
        for name, entries in parse(text, "JSON text").items():
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

    def _start(self, table: _Table, key: int, capacity: int) -> Tuning:
        assert self._binding is not None
        space = self._binding.space
        if self._prior is not None:
            space = dataclasses.replace(space, skip=self._pruned(space, capacity))
            if space.skip:
                _log.info("tuner: the prior leaves out %s at capacity %d", ", ".join(map(str, sorted(
                    space.skip, key=str))), capacity)
        return Tuning(space, self._warmup, self._repeats)

    def _pruned(self, space: Space, capacity: int) -> frozenset[Config]:
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
        save(path, {name: table.entries for name, table in self._tables.items() if table.changed},
                 {name: table.entries for name, table in self._tables.items() if not table.changed})


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
