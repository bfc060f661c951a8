"""Measurements in, a fitted :class:`~a2a.sim.model.Topology` out.

:func:`load_measurements` reads the JSON rows of ``python -m a2a.bench --json``
(a list of rows, or an object whose ``"rows"`` is one). A row is used when it
has the fields the model needs, whatever wrote it: ``algo`` (one of
:data:`a2a.sim.model.FORMS`), ``size`` (bytes each rank sends), a time
(``time_us``, ``time_s``, or ``time`` in microseconds as nccl-tests prints
it), ``ranks`` and ``local_size`` (or ``num_nodes``); flex and combine rows
also ``shape`` and ``type``, and ``inner_algo``; v rows ``count`` and
``type``; rows of the namespace cluster ``link`` (the link's rate, predicted
as such) and ``cross_check`` (false: the argument check was off). Baseline
rows (``baseline``: true, or algo ``mpi`` / ``d2d``) are skipped, and so are
rows of other algorithms, with the reason.

:func:`fit` fits a topology's parameters by least squares on the relative
error, ``log(predicted / measured)`` per row, so that a 10 us row counts as
much as a 10 ms one: Levenberg-Marquardt over the logarithms of the
parameters (which keeps them positive), the Jacobian by finite differences.
Parameters the rows cannot tell apart from nothing (a column of zeros in the
Jacobian: the inter-node link of an emulated run, for one) keep the
preset's value and are reported as not fitted. On a host whose runs jump
(``outlier_scale``) the squares become a soft-L1 loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .model import ALGOS, FORMS, Prediction, flex_layout, predict, predict_flex, predict_v
from .topology import FITTABLE, Topology

__all__ = ["FitResult", "FitRow", "Measurement", "fit", "link_rate", "load_measurements", "median_rows",
           "predict_measurement", "ratio_rows", "size_crossovers"]

ITEMSIZES = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "half": 2, "float": 4, "double": 8, "bfloat16": 2}
BASELINE_ALGOS = ("mpi", "d2d")


@dataclass(frozen=True)
class Measurement:
    """One measured call: what ran, on which shape, and its time."""

    algo: str  # one of FORMS
    size: int  # bytes each rank sends (the mean for v)
    ranks: int
    local_size: int
    time_s: float
    inner_algo: str = "linear"  # flex, combine, v: the exchange underneath
    shape: tuple[int, ...] = ()  # flex, combine: the input's shape
    itemsize: int = 0
    count: int = 0  # v: elements per peer (the mean)
    check: str = ""  # how the argument check ran (a CHECKS name); "": the topology's
    link: str = ""  # the namespace cluster's link rate ("unshaped", "1gbit", ...); "": not said
    source: str = ""

    @property
    def label(self) -> str:
        algo = self.algo if self.algo in ALGOS else f"{self.algo}/{self.inner_algo}"
        unchecked = " unchecked" if self.check == "none" else ""
        link = f" {self.link}" if self.link else ""
        return f"{algo} {self.ranks // self.local_size}x{self.local_size} {_bytes(self.size)}{link}{unchecked}"


@dataclass(frozen=True)
class FitRow:
    measurement: Measurement
    predicted: Prediction

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted.time_s / self.measurement.time_s - 1


@dataclass
class FitResult:
    topology: Topology
    rows: list[FitRow]
    fitted: tuple[str, ...]  # parameters fitted
    kept: tuple[str, ...]  # asked for, but the rows do not depend on them: the preset's value kept
    iterations: int
    skipped: list[str] = field(default_factory=list)

    @property
    def rms_error(self) -> float:
        """Root mean square of the relative errors (predicted / measured - 1)."""
        return math.sqrt(sum(r.error ** 2 for r in self.rows) / len(self.rows))

    @property
    def max_error(self) -> float:
        return max(abs(r.error) for r in self.rows)


# ---------------------------------------------------------------------------
# Loading


def load_measurements(path: str | os.PathLike[str]) -> tuple[list[Measurement], list[str]]:
    """The usable rows of a file, and a line per row skipped saying why: JSON
    (``python -m a2a.bench --json``, or rows with the same fields), or the
    text output of an ``alltoall_perf`` in nccl-tests' format
    (``nccl_tests_ext/``, or NVIDIA's nccl-tests)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("#"):  # nccl-tests' output starts with its header block
            return nccl_tests_rows(text, str(path))
        raise ValueError(f"{path}: neither JSON nor nccl-tests output: {error}") from None
    rows = document.get("rows") if isinstance(document, dict) else document
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows (python -m a2a.bench --json) or an object with "  # noqa: TRY004 (a malformed file)
                         "'rows'")
    return parse_rows(rows, str(path))


_A2A_ALGORITHM = re.compile(r"^# a2a: .*\balgorithm (\w+)", re.MULTILINE)
_NODE_OF_RANK = re.compile(r"\bnode (\d+)\b")


def nccl_tests_rows(text: str, origin: str = "output") -> tuple[list[Measurement], list[str]]:
    """The out-of-place rows of an ``alltoall_perf`` run in nccl-tests' format
    as uniform all-to-all measurements. The algorithm: the ``# a2a: ...
    algorithm X`` line of nccl_tests_ext, else linear (NCCL's all-to-all, one
    send and one receive per peer). Ranks: the device lines; nodes: the
    ``node N`` of nccl_tests_ext's lines (emulated nodes too), else the
    distinct host names. An output that does not name its program (nccl-tests
    before 2.13 has no "Collective test starting" line) is taken for
    alltoall_perf's. Rows of size 0 move nothing and are skipped."""
    from .. import nccl_format

    try:
        report = nccl_format.parse(text)
    except nccl_format.FormatError as error:
        raise ValueError(f"{origin}: not nccl-tests output: {error}") from None
    if report.program not in (None, "alltoall_perf"):  # older nccl-tests do not name the program
        raise ValueError(f"{origin}: the model is fitted to alltoall_perf (uniform all-to-all) output, got "
                         f"{report.program or 'a program it does not name'}: use python -m a2a.bench --json for "
                         "the flexible and uneven forms")
    if not report.devices:
        raise ValueError(f"{origin}: no '#  Rank ...' device lines: cannot tell ranks and nodes")
    nodes = set()
    for device in report.devices:
        found = _NODE_OF_RANK.search(device.bus)
        nodes.add(found.group(1) if found else device.host)
    ranks = len(report.devices)
    if ranks % len(nodes):
        raise ValueError(f"{origin}: {ranks} ranks on {len(nodes)} nodes are not whole nodes")
    found = _A2A_ALGORITHM.search(text)
    algo = found.group(1) if found else "linear"
    rows, skipped = [], []
    for index, row in enumerate(report.rows):
        group = row.out_of_place
        if row.size == 0 or group is None or not group.time_us > 0:
            skipped.append(f"{origin} row {index}: size {row.size}: nothing moved, or no out-of-place time")
            continue
        rows.append({"algo": algo, "size": row.size, "time": group.time_us, "ranks": ranks,
                     "local_size": ranks // len(nodes), "type": row.type})
    measurements, more = parse_rows(rows, origin)
    return measurements, skipped + more


def parse_rows(rows: Iterable[Any], origin: str = "rows") -> tuple[list[Measurement], list[str]]:
    measurements, skipped = [], []
    for index, row in enumerate(rows):
        where = f"{origin} row {index}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")  # noqa: TRY004
        algo = row.get("algo")
        if row.get("baseline") or algo in BASELINE_ALGOS:
            skipped.append(f"{where}: baseline {algo}")
            continue
        if algo not in FORMS:
            skipped.append(f"{where}: algo {algo!r} is not one the model predicts ({', '.join(FORMS)})")
            continue
        measurements.append(_measurement(row, algo, where))
    return measurements, skipped


def _measurement(row: dict, algo: str, where: str) -> Measurement:
    def need(name: str) -> Any:
        if row.get(name) is None:
            raise ValueError(f"{where} ({algo}): no {name!r}")
        return row[name]

    if row.get("time_s") is not None:
        seconds = float(row["time_s"])
    elif row.get("time_us") is not None:
        seconds = float(row["time_us"]) * 1e-6
    elif row.get("time") is not None:
        seconds = float(row["time"]) * 1e-6
    else:
        raise ValueError(f"{where} ({algo}): no time (time_us, time_s or time in us)")
    if not seconds > 0:
        raise ValueError(f"{where} ({algo}): time must be > 0, got {seconds} s")
    ranks = int(need("ranks"))
    if row.get("local_size") is not None:
        local = int(row["local_size"])
    elif row.get("num_nodes") is not None:
        local = ranks // int(row["num_nodes"])
    else:
        raise ValueError(f"{where} ({algo}): no 'local_size' or 'num_nodes'")
    if ranks < 1 or local < 1 or ranks % local:
        raise ValueError(f"{where} ({algo}): {ranks} ranks are not whole nodes of {local}")
    extra: dict[str, Any] = {}
    if algo in ("flex", "combine", "v", "v-plan"):
        type_name = need("type")
        if type_name not in ITEMSIZES:
            raise ValueError(f"{where} ({algo}): unknown type {type_name!r}")
        extra["itemsize"] = ITEMSIZES[type_name]
        extra["inner_algo"] = row.get("inner_algo") or "linear"
        if extra["inner_algo"] not in ALGOS:
            raise ValueError(f"{where} ({algo}): inner_algo must be one of {ALGOS}, got {extra['inner_algo']!r}")
    if algo in ("flex", "combine"):
        extra["shape"] = tuple(int(n) for n in need("shape"))
    if algo in ("v", "v-plan"):
        extra["count"] = int(need("count"))
    if row.get("cross_check") is False:  # A2A_CROSS_CHECK=0: the ranks' arguments are not compared
        extra["check"] = "none"
    if row.get("link"):
        extra["link"] = str(row["link"])
        try:
            link_rate(extra["link"])
        except ValueError as error:
            raise ValueError(f"{where} ({algo}): {error}") from None
    return Measurement(algo, int(need("size")), ranks, local, seconds, source=where, **extra)


def median_rows(measurements: Iterable[Measurement]) -> list[Measurement]:
    """One row per distinct call (algo, shape, size, ...), its time the median over
    the rows of it (several runs of the same sweep), in the order first seen."""
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        key = (m.algo, m.size, m.ranks, m.local_size, m.inner_algo, m.shape, m.itemsize, m.count, m.check, m.link)
        groups.setdefault(key, []).append(m)
    merged = []
    for rows in groups.values():
        times = sorted(m.time_s for m in rows)
        middle = len(times) // 2
        median = times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2
        sources = ", ".join(m.source for m in rows)
        merged.append(dataclasses.replace(rows[0], time_s=median, source=f"median of {len(rows)}: {sources}"))
    return merged


# ---------------------------------------------------------------------------
# Predicting a measured row


def predict_measurement(topology: Topology, m: Measurement) -> Prediction:
    """The model's prediction for the call `m` measured, on `topology` at its shape."""
    top = topology.with_ranks(m.ranks, m.local_size)
    if m.check:
        top = top.replace(check=m.check)
    if m.link:
        top = top.replace(link_rate=link_rate(m.link))
    if m.algo in ALGOS:
        return predict(top, m.algo, m.size)
    if m.algo in ("flex", "combine"):
        split, concat = (0, 1) if m.algo == "flex" else (1, 0)
        return predict_flex(top, m.inner_algo, flex_layout(m.shape, split, concat, m.itemsize, m.ranks))
    from .._sweep import v_counts  # the benchmark's uneven counts, element for element

    counts = np.asarray(v_counts(m.ranks, m.count), dtype=np.int64) * m.itemsize
    return predict_v(top, m.inner_algo, counts, plan=m.algo == "v")


def _pair_key(m: Measurement) -> tuple:
    """What a linear row and a 2dh row must share to be compared: the shape, the size, the check, the link."""
    return (m.ranks, m.local_size, m.size, m.check, m.link)


def link_rate(link: str) -> float:
    """Bytes per second of a namespace cluster's link as a row names it: ``"unshaped"``
    is 0 (no shaping), ``"10gbit"``, ``"500mbit"`` are tc's rates, read as the cluster
    tool that shaped the link reads them."""
    from ..cluster import parse_rate

    if link == "unshaped":
        return 0.0
    try:
        return parse_rate(link) / 8
    except ValueError:
        raise ValueError(f"link {link!r}: expected 'unshaped' or a tc rate such as 10gbit or 500mbit") from None


def ratio_rows(rows: Sequence[FitRow]) -> list[dict[str, Any]]:
    """For every (shape, size, check, link) measured with both linear and 2dh: the
    measured and predicted ratio of linear's time to 2DH's, and the error of the
    predicted one."""
    by_key: dict[tuple, dict[str, FitRow]] = {}
    for row in rows:
        m = row.measurement
        if m.algo in ALGOS:
            by_key.setdefault(_pair_key(m), {})[m.algo] = row
    out = []
    for (ranks, local, size, check, link), pair in sorted(by_key.items()):
        if len(pair) != 2:
            continue
        measured = pair["linear"].measurement.time_s / pair["2dh"].measurement.time_s
        predicted = pair["linear"].predicted.time_s / pair["2dh"].predicted.time_s
        out.append({"ranks": ranks, "local_size": local, "nodes": ranks // local, "size": size, "check": check,
                    "link": link, "measured": measured, "predicted": predicted, "error": predicted / measured - 1})
    return out


def size_crossovers(rows: Sequence[FitRow], tie: float = 0.05) -> list[dict[str, Any]]:
    """Per (shape, check, link) measured with both linear and 2dh: the smallest size
    from which the other algorithm than at the smallest sizes is the faster one,
    measured and predicted (None: never), and ``steps``, how many sizes of the sweep
    apart the two are (never counts as one size past the largest). Times within
    `tie` of each other are a tie, which changes nothing: on a wire-bound link both
    move the same bytes at the same rate, and which one a run finds faster is noise."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for ratio in ratio_rows(rows):
        groups.setdefault((ratio["ranks"], ratio["local_size"], ratio["check"], ratio["link"]), []).append(ratio)
    out = []
    for (ranks, local, check, link), ratios in groups.items():
        sizes = [r["size"] for r in ratios]  # ratio_rows sorts them
        measured, predicted = (_first_change([r[column] for r in ratios], tie) for column in ("measured", "predicted"))
        out.append({"ranks": ranks, "local_size": local, "nodes": ranks // local, "check": check, "link": link,
                    "sizes": sizes, "measured": sizes[measured] if measured < len(sizes) else None,
                    "predicted": sizes[predicted] if predicted < len(sizes) else None,
                    "steps": abs(measured - predicted)})
    return out


# ---------------------------------------------------------------------------
# Fitting


def fit(topology: Topology, measurements: Sequence[Measurement], parameters: Sequence[str] | None = None,
        *, ratio_weight: float = 2.0, max_iterations: int = 200, outlier_scale: float = 0.0) -> FitResult:
    """`topology` with `parameters` (default: every numeric one) fitted to
    `measurements` by least squares on log(predicted / measured) of each row
    and, weighted by `ratio_weight`, of each ratio linear / 2dh (the rows of
    both at one shape and size). `outlier_scale` > 0: the soft-L1 loss, for
    rows of a host whose runs jump (see _robust)."""
    if not measurements:
        raise ValueError("fit: no measurements to fit")
    if not ratio_weight >= 0:
        raise ValueError(f"fit: ratio_weight must be >= 0, got {ratio_weight}")
    pairs = _pairs(measurements)
    names = list(FITTABLE if parameters is None else parameters)
    for name in names:
        if name not in FITTABLE:
            raise ValueError(f"fit: {name!r} is not a parameter; the parameters are {', '.join(FITTABLE)}")
        if not getattr(topology, name) > 0:
            raise ValueError(f"fit: {name} starts at {getattr(topology, name)}; fitting needs a positive start")
    measured = np.log([m.time_s for m in measurements])

    def residuals(top: Topology) -> np.ndarray:
        rows = np.log([predict_measurement(top, m).time_s for m in measurements]) - measured
        if not pairs or ratio_weight == 0:
            return _robust(rows, outlier_scale)
        ratios = [rows[i] - rows[j] for i, j in pairs]  # log of predicted ratio / measured ratio
        return _robust(np.concatenate([rows, ratio_weight * np.asarray(ratios)]), outlier_scale)

    def at(x: np.ndarray, which: list[str]) -> Topology:
        return topology.replace(**{name: float(math.exp(v)) for name, v in zip(which, x)})

    def jacobian(x: np.ndarray, which: list[str], r: np.ndarray) -> np.ndarray:
        step = 1e-5
        columns = []
        for i in range(len(x)):
            moved = x.copy()
            moved[i] += step
            columns.append((residuals(at(moved, which)) - r) / step)
        return np.stack(columns, axis=1)

    x = np.log([getattr(topology, name) for name in names])
    r = residuals(topology)
    # Which parameters the rows depend on at all.
    full = jacobian(x, names, r)
    used = [i for i in range(len(names)) if np.abs(full[:, i]).max() > 1e-9]
    fitted = [names[i] for i in used]
    kept = tuple(name for name in names if name not in fitted)
    x = x[used]
    damping, iterations = 1e-3, 0
    cost = float(r @ r)
    for iterations in range(1, max_iterations + 1):
        if not fitted:
            break
        j = jacobian(x, fitted, r)
        normal = j.T @ j
        gradient = j.T @ r
        improved = False
        while damping < 1e12:
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
            trial = x + np.clip(step, -2.0, 2.0)  # at most a factor e^2 per step
            trial_r = residuals(at(trial, fitted))
            trial_cost = float(trial_r @ trial_r)
            if trial_cost < cost:
                improved = cost - trial_cost > 1e-12 * max(cost, 1e-30)
                x, r, cost = trial, trial_r, trial_cost
                damping = max(damping / 3, 1e-9)
                break
            damping *= 4
        if not improved:
            break
    top = at(x, fitted)
    rows = [FitRow(m, predict_measurement(top, m)) for m in measurements]
    return FitResult(top, rows, tuple(fitted), kept, iterations)


def _robust(residuals: np.ndarray, scale: float) -> np.ndarray:
    """The residuals whose squares sum to the soft-L1 cost ``2 s^2 (sqrt(1 + (r/s)^2) - 1)``:
    quadratic below `scale`, linear beyond, so that a row the shared host slowed by 3x
    pulls no harder than one off by a little over `scale`; 0: plain least squares."""
    if not scale:
        return residuals
    return np.sign(residuals) * np.sqrt(2 * scale**2 * (np.sqrt(1 + (residuals / scale) ** 2) - 1))


def _first_change(ratios: Sequence[float], tie: float) -> int:
    """The index of the first ratio linear / 2dh on the other side of 1 than the first
    that is not a tie; len(ratios) when there is none."""
    faster = [(r > 1 + tie) - (r < 1 / (1 + tie)) for r in ratios]  # +1: 2dh faster, -1: linear, 0: a tie
    first = next((f for f in faster if f), 0)
    return next((i for i, f in enumerate(faster) if f == -first != 0), len(ratios))


def _pairs(measurements: Sequence[Measurement]) -> list[tuple[int, int]]:
    """Indices (linear, 2dh) of the rows measured with both at one shape and size."""
    index = {(m.algo, *_pair_key(m)): i for i, m in enumerate(measurements) if m.algo in ALGOS}
    return [(i, index[("2dh", *key[1:])]) for key, i in index.items()
            if key[0] == "linear" and ("2dh", *key[1:]) in index]


def _bytes(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"
