"""The picture of a collectives sweep (``python -m a2a.bench --plot FILE.png``).

One figure, one PNG:

* top: busbw (GB/s) against the size per rank (log scale), one line per
  algorithm the run measured, the baselines (``mpi``, ``gloo``, ``d2d``) in
  grey, dashed; predicted curves (the scale model's busbw for the same
  sizes), when given, dotted in the colour of the algorithm they predict;
* below it, one panel per baseline: each algorithm's algbw divided by the
  baseline's at the same size, from the same run, on a log scale (1.0
  drawn as a line).

matplotlib is an optional extra (``pip install 'a2a[plots]'``); this module
imports it only inside :func:`plot_sweep`, through its object API (no pyplot,
no global backend), so a2a never needs a display. :func:`matplotlib_missing`
says, without importing it, whether a ``--plot`` can be honoured, so that the
command line can refuse before a sweep rather than after it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from . import common

__all__ = ["INSTALL_HINT", "Prediction", "matplotlib_missing", "plot_sweep"]

INSTALL_HINT = "pip install 'a2a[plots]' (or pip install matplotlib)"

# (algo, size in bytes per rank, busbw in GB/s): one point of a predicted curve.
Prediction = tuple[str, int, float]

_BASELINE_STYLES = {"mpi": "s", "gloo": "D", "d2d": "^"}  # marker per baseline
_BASELINE_LABELS = {"mpi": "MPI_Alltoall", "gloo": "gloo all_to_all_single", "d2d": "device copy"}


def matplotlib_missing(flag: str = "--plot") -> str | None:
    """The error for `flag` when matplotlib is not installed, else None (does not import it)."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module object without a spec stands in for it
        found = False
    return None if found else f"{flag} needs matplotlib, which is not installed: {INSTALL_HINT}"


def plot_sweep(rows: list[dict], path: str, predicted: Iterable[Prediction] | None = None) -> None:
    """Draws the rows of one sweep (the records of ``--json``) to the PNG `path`.

    `rows` need ``algo``, ``size``, ``busbw``, ``algbw``, ``baseline`` and
    ``type``; rows of several datatypes get one line per (algo, type).
    `predicted`: (algo, size, busbw) points, drawn beside the measured line of
    the same algo (or alone, when `rows` is empty: a prediction without a
    measurement). Points of size 0 have no place on a log axis and are left
    out."""
    message = matplotlib_missing()
    if message is not None:
        raise RuntimeError(message)
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in rows if r["size"] > 0]
    by_algo: dict[str, list[tuple[int, float]]] = {}
    for algo, size, busbw in predicted or ():
        if size > 0:
            by_algo.setdefault(algo, []).append((size, busbw))
    if not rows and not by_algo:
        raise ValueError("plot_sweep: no rows or predicted points of positive size to draw")
    types = list(dict.fromkeys(r["type"] for r in rows))
    baselines = list(dict.fromkeys(r["algo"] for r in rows if r["baseline"]))
    algos = list(dict.fromkeys(r["algo"] for r in rows if not r["baseline"]))

    def series(algo: str) -> list[tuple[str, list[dict]]]:
        """(label, rows by size) per datatype of `algo`."""
        out = []
        for dtype in types:
            mine = sorted((r for r in rows if r["algo"] == algo and r["type"] == dtype), key=lambda r: r["size"])
            if mine:
                out.append((algo if len(types) == 1 else f"{algo} {dtype}", mine))
        return out

    figure = Figure(figsize=(8.0, 4.2 + 2.4 * len(baselines)), layout="constrained")
    heights = [2.0] + [1.0] * len(baselines)
    axes = figure.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    bandwidth = axes[0]
    colours: dict[str, str] = {}
    for algo in algos:
        for label, mine in series(algo):
            (line,) = bandwidth.plot([r["size"] for r in mine], [r["busbw"] for r in mine], marker="o", ms=3,
                                     label=label)
            colours.setdefault(algo, line.get_color())
    for base in baselines:
        for label, mine in series(base):
            bandwidth.plot([r["size"] for r in mine], [r["busbw"] for r in mine], color="0.35", linestyle="--",
                           marker=_BASELINE_STYLES.get(base, "s"), ms=3,
                           label=label.replace(base, _BASELINE_LABELS.get(base, base), 1))
    for algo, points in by_algo.items():
        points.sort()
        bandwidth.plot(*zip(*points), linestyle=":", linewidth=2, color=colours.get(algo),
                       label=f"{algo} (predicted)")
    bandwidth.set_ylabel("busbw (GB/s)")
    bandwidth.set_ylim(bottom=0)
    bandwidth.grid(True, alpha=0.3)
    bandwidth.legend(fontsize=7, ncol=2)
    bandwidth.set_title(_title(rows, types), fontsize=9)

    for ax, base in zip(axes[1:], baselines):
        base_algbw = {(r["type"], r["size"]): r["algbw"] for r in rows if r["algo"] == base}
        for algo in algos:
            for label, mine in series(algo):
                points = [(r["size"], r["algbw"] / base_algbw[r["type"], r["size"]]) for r in mine
                          if base_algbw.get((r["type"], r["size"]))]
                if points:
                    ax.plot(*zip(*points), marker="o", ms=3, color=colours[algo], label=label)
        ax.axhline(1.0, color="0.35", linestyle="--", linewidth=1)
        ax.set_ylabel(f"algbw / {base}")
        ax.set_yscale("log", base=2)  # 0.5x and 2x equally far from 1
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:.3g}x"))
        ax.grid(True, alpha=0.3)
        ax.set_title(f"ours / {_BASELINE_LABELS.get(base, base)} (same run; above 1: ours is faster)", fontsize=8)

    bottom = axes[-1]
    bottom.set_xscale("log", base=2)
    bottom.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: common.size_text(int(x)) if x >= 1 else ""))
    bottom.set_xlabel("size per rank (bytes)")
    figure.savefig(path, dpi=110)


def _title(rows: list[dict], types: list[str]) -> str:
    if not rows:
        return "a2a: predicted busbw"
    first = rows[0]
    where = f"{first['ranks']} ranks" if "ranks" in first else ""
    if "num_nodes" in first and "local_size" in first:
        where += f" = {first['num_nodes']} node(s) x {first['local_size']}"
    if first.get("device") == "cuda":
        where += f", cuda ({first.get('transport')})"
    return f"python -m a2a.bench: {where}, {', '.join(types)}"
