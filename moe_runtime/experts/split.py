"""Splitting a total (a batch, a hidden size) into per-rank parts that sum to
it exactly: in proportion to each rank's speed (Hexa-MoE's Equations 1 and 2,
used by moe_runtime.hexa) or evenly (the shared experts of Tutel's layout).

The parts are rounded so that they sum to the total exactly: each rank gets
the floor of its share (in units of ``multiple``), and the units left over
go one each to the ranks with the largest fractional remainders, ties to the
lower rank (largest remainder, Hamilton's method). The shares are computed
in exact rational arithmetic from the float latencies, so every rank rounds
the same way and equal latencies give equal parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["check_count", "check_latencies", "offsets", "split_by_latency", "uniform_split"]


def check_count(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_latencies(latencies: Sequence[float]) -> list[float]:
    try:
        values = [float(latency) for latency in latencies]
    except (TypeError, ValueError) as error:
        raise ValueError(f"latencies must be a sequence of positive numbers, got {latencies!r}") from error
    if not values:
        raise ValueError("latencies: give one latency per rank (got none)")
    bad = [(rank, value) for rank, value in enumerate(values) if not (math.isfinite(value) and value > 0)]
    if bad:
        shown = ", ".join(f"rank {rank}: {value!r}" for rank, value in bad)
        raise ValueError(f"latencies must be finite and positive ({shown})")
    return values


def split_by_latency(total: int, latencies: Sequence[float], multiple: int = 1) -> list[int]:
    """Parts of `total`, one per rank, proportional to 1/latency (Equations 1
    and 2), each a multiple of `multiple`, summing to `total` exactly.

    ``latencies``: one positive, finite latency per rank (seconds, or any
    unit common to all). ``total``: a non-negative multiple of ``multiple``
    (>= 1). A part may be 0 (see the module docstring).

    >>> split_by_latency(100, [4.58, 3.06])
    [40, 60]
    >>> split_by_latency(10, [1.0, 1.0, 1.0])  # one unit left over: rank 0
    [4, 3, 3]
    """
    total = check_count("total", total, 0)
    multiple = check_count("multiple", multiple, 1)
    values = check_latencies(latencies)
    if total % multiple != 0:
        raise ValueError(f"total {total} is not a multiple of multiple={multiple}: the parts could not sum to it")
    units = total // multiple
    speeds = [1 / Fraction(value) for value in values]  # exact: a float is a rational
    whole = sum(speeds)
    shares = [units * speed / whole for speed in speeds]
    parts = [math.floor(share) for share in shares]
    left = units - sum(parts)
    # The largest fractional remainders first; sorted() is stable, so ties keep rank order.
    by_remainder = sorted(range(len(values)), key=lambda rank: -(shares[rank] - parts[rank]))
    for rank in by_remainder[:left]:
        parts[rank] += 1
    return [part * multiple for part in parts]


def uniform_split(total: int, ranks: int, multiple: int = 1) -> list[int]:
    """The split of equal latencies: `total` in `ranks` parts as equal as
    multiples of `multiple` allow, the larger ones on the lower ranks."""
    ranks = check_count("ranks", ranks, 1)
    return split_by_latency(total, [1.0] * ranks, multiple)


def offsets(parts: Sequence[int]) -> list[int]:
    """[0, p0, p0 + p1, ..., sum]: where each rank's part starts (and the end)."""
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + int(part))
    return starts
