"""One key's search over the configurations of a layer.

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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from .config import DATA_PARALLEL, Config, flow_config

__all__ = ["Space", "Tuning"]


@dataclass(frozen=True)
class Space:
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


def _search(space: Space) -> Generator[Config, float, tuple[Config, float]]:
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


class Tuning:
    """A running search at one key: turns reports into trial times for it."""

    def __init__(self, space: Space, warmup: int, repeats: int):
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
