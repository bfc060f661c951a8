"""``python -m a2a.sim``: predict with a preset, or fit one to measurements.

    python -m a2a.sim predict --preset a100 --ranks 64,256,2048,4096 --sizes 1M,32M,256M
    python -m a2a.sim predict --preset a100 --check none --json pred.json --plot fig18.png
    python -m a2a.sim fit bench.json [more.json ...] --preset local [--out local.json]
    python -m a2a.sim predict --preset cluster --measured held_out.json [...]
    python -m a2a.sim presets

``predict`` prints, per (ranks, size), linear's and 2DH's predicted time
and the time of each phase, the ratio and the faster one, then per size the
crossover: the GPU count from which 2DH is faster, scanned over 2, 4, 8 ...
nodes up to the largest ``--ranks``. ``--json FILE`` writes one record per
(preset, ranks, size, algorithm): ``time_s``, ``busbw`` (bytes/s) and
``phases`` (name -> seconds). ``--params FILE`` predicts with a fitted
topology (``fit --out``) instead of a preset. ``--measured FILE ...``
predicts measured rows instead (runs the preset was not fitted on): each
row's error, the ratios linear / 2dh and, per shape, the size from which the
other algorithm is faster, measured and predicted.

``fit`` reads ``python -m a2a.bench --json`` rows (or any rows with the same
fields: docs/scaling.md), fits the preset's parameters (``--fit`` names
others) by least squares on the relative error, and prints the parameters,
every row's measured and predicted time with its error, and, where linear
and 2dh were both measured, the ratio of their times measured and
predicted, and where the faster of the two changes. A row of the namespace
cluster is predicted on its own link rate (``link``) and with the argument
check it ran (``cross_check``), so one fit can take every rate's rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from .._sweep import parse_size
from . import fitting, model, presets
from .topology import FITTABLE

FILE_FORMAT = "a2a.sim.topology"


def _sizes(text: str) -> list[int]:
    return _comma_list(text, parse_size, "sizes (K/M/G suffixes)")


def _ints(text: str) -> list[int]:
    return _comma_list(text, int, "integers")


def _comma_list(text: str, convert: Callable[[str], int], what: str) -> list[int]:
    try:
        return [convert(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.sim", description="Scale model of a2a's all-to-all "
                                "(alpha-beta, phase by phase): predict with a preset, or fit one to measurements.",
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("predict", help="predicted time of linear and 2DH per phase, and the crossover",
                        allow_abbrev=False)
    pr.add_argument("--preset", default="a100", help=f"one of {', '.join(presets.PRESETS)}, or a comma list "
                    "(default a100)")
    pr.add_argument("--params", metavar="FILE", help="a fitted topology (fit --out) instead of --preset")
    pr.add_argument("--ranks", type=_ints, default=[64, 256, 2048, 4096],
                    help="GPU (rank) counts, comma list (default 64,256,2048,4096)")
    pr.add_argument("--local-size", type=int, help="ranks per node (default: the preset's)")
    pr.add_argument("--sizes", type=_sizes, default=_sizes("1M,32M,256M"),
                    help="bytes per rank, comma list with K/M/G (default 1M,32M,256M)")
    pr.add_argument("--check", choices=model.CHECKS, help="how the argument check runs (default: the preset's; "
                    "none: nccl-tests' all-to-all, as in Tutel's figures)")
    pr.add_argument("--measured", nargs="+", metavar="FILE", help="predict these measured rows (a2a.bench --json) "
                    "instead of --ranks x --sizes, with each row's error (runs the preset was not fitted on)")
    pr.add_argument("--json", metavar="FILE", help="write one record per (preset, ranks, size, algorithm); with "
                    "--measured, the rows' report")
    pr.add_argument("--plot", metavar="FILE.png", help="draw the predictions (needs matplotlib)")
    pr.add_argument("--plot-x", choices=("ranks", "size"), default="ranks",
                    help="x axis of --plot: GPU count (a panel per size) or size (a panel per GPU count)")
    pr.add_argument("--plot-y", choices=("time", "busbw"), default="time", help="y axis of --plot")

    ft = sub.add_parser("fit", help="fit a preset's parameters to a2a.bench JSON rows or alltoall_perf output",
                        allow_abbrev=False)
    ft.add_argument("files", nargs="+", metavar="FILE", help="python -m a2a.bench --json output, or the text "
                    "output of an alltoall_perf in nccl-tests' format (nccl_tests_ext/, or NVIDIA's nccl-tests)")
    ft.add_argument("--preset", default="local", help="the starting point and structure (default local)")
    ft.add_argument("--fit", metavar="NAMES", help="comma list of the parameters to fit (default: the preset's: "
                    + "; ".join(f"{k}: {','.join(v)}" for k, v in presets.FIT_PARAMETERS.items()) + ")")
    ft.add_argument("--check", choices=model.CHECKS, help="how the argument check runs (default: the preset's; "
                    "none for NVIDIA nccl-tests' output: NCCL checks nothing across ranks)")
    ft.add_argument("--ratio-weight", type=float, default=2.0, help="weight of the ratios linear / 2dh against "
                    "the rows in the least squares (default 2: ratios within a run are steadier than times)")
    ft.add_argument("--outlier-scale", type=float, help="soft-L1 loss: residuals (log of predicted / measured) "
                    "beyond this count linearly, not squared (default: the preset's: "
                    + ", ".join(f"{k}: {v:g}" for k, v in presets.FIT_OUTLIER_SCALE.items()) + "; others 0, least "
                    "squares)")
    ft.add_argument("--out", metavar="FILE", help="write the fitted topology (for predict --params)")
    ft.add_argument("--json", metavar="FILE", help="write the fit's report: parameters, rows, errors, ratios")

    sub.add_parser("presets", help="print every preset's parameters", allow_abbrev=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "predict":
            return _predict(args)
        if args.command == "fit":
            return _fit(args)
        for topology in presets.PRESETS.values():
            print(f"{topology.name}: " + ", ".join(f"{k}={v}" for k, v in topology.parameters().items()
                                                   if k != "name"))
        return 0
    except (ValueError, RuntimeError, OSError) as error:
        print(f"a2a.sim {args.command}: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------
# predict


def load_topology(path: str) -> model.Topology:
    """A topology written by ``fit --out``."""
    with open(path, encoding="utf-8") as fh:
        document = json.load(fh)
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: not an {FILE_FORMAT} file (python -m a2a.sim fit --out writes one)")
    return model.Topology(**document["topology"])


def _topologies(args: argparse.Namespace) -> list[model.Topology]:
    tops = [load_topology(args.params)] if args.params else [presets.preset(n.strip()) for n in args.preset.split(",")]
    if args.check:
        tops = [t.replace(check=args.check) for t in tops]
    return tops


def records_for(topology: model.Topology, ranks: list[int], sizes: list[int], local_size: int | None = None,
                ) -> list[dict[str, Any]]:
    """One record per (ranks, size, algorithm): predict --json's."""
    records = []
    for w in ranks:
        top = topology.with_ranks(w, local_size)
        for size in sizes:
            for algo in model.ALGOS:
                p = model.predict(top, algo, size)
                records.append({"preset": topology.name, "ranks": w, "nodes": top.nodes,
                                "local_size": top.local_size, "size": p.size, "requested_size": size, "algo": algo,
                                "check": top.check, "time_s": p.time_s, "busbw": p.busbw,
                                "phases": p.phase_times()})
    return records


def _phases_text(record: dict) -> str:
    return " ".join(f"{name} {seconds * 1e6:.4g}" for name, seconds in record["phases"].items())


def _predict(args: argparse.Namespace) -> int:
    if args.measured:
        return _predict_measured(args)
    if not args.ranks or not args.sizes:
        raise ValueError("--ranks and --sizes must not be empty")
    all_records = []
    for top in _topologies(args):
        local = args.local_size or top.local_size
        for w in args.ranks:
            if w < 1 or w % local:
                raise ValueError(f"--ranks {w} is not a whole number of nodes of {local} ranks")
        records = records_for(top, args.ranks, args.sizes, local)
        all_records += records
        shaped = top.with_ranks(local * max(1, top.nodes), local)
        print(f"# a2a.sim predict: {top.name}, {local} ranks per node, check {top.check}; times in us; "
              f"phases: linear = check + exchange, 2dh = check + copy1 + intra + copy2 + inter")
        print(f"# {'ranks':>6} {'nodes':>9} {'size':>6} {'linear':>10} {'2dh':>10} {'lin/2dh':>8} {'faster':>6}"
              "  phases (linear | 2dh)")
        for i in range(0, len(records), 2):
            lin, two = records[i], records[i + 1]
            ratio = lin["time_s"] / two["time_s"]
            print(f"  {lin['ranks']:>6} {lin['nodes']:>4}x{lin['local_size']:<4} {fitting._bytes(lin['size']):>6} "
                  f"{lin['time_s'] * 1e6:>10.1f} {two['time_s'] * 1e6:>10.1f} {ratio:>8.2f} "
                  f"{'2dh' if ratio > 1 else 'linear':>6}  {_phases_text(lin)} | {_phases_text(two)}")
        scan = model.power_of_two_ranks(local, max(args.ranks))
        if scan:
            found = [(size, model.crossover(shaped, size, scan)) for size in args.sizes]
            print(f"# crossover: 2dh faster than linear from this many ranks on (scanned {scan[0]}..{scan[-1]}, "
                  "powers of two nodes): "
                  + "; ".join(f"{fitting._bytes(size)}: {'never' if w is None else w}" for size, w in found))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(all_records, fh, indent=1)
            fh.write("\n")
    if args.plot:
        from .plot import write_plot

        names = ", ".join(dict.fromkeys(f"{r['preset']} (check {r['check']})" for r in all_records))
        write_plot(args.plot, all_records, x=args.plot_x, y=args.plot_y,
                   title=f"a2a.sim: predicted all-to-all, linear vs 2DH, {names}")
    return 0


def _predict_measured(args: argparse.Namespace) -> int:
    tops = _topologies(args)
    if len(tops) != 1:
        raise ValueError("--measured predicts with one topology: one --preset, or --params")
    top = tops[0]
    measurements, skipped = _load(args.measured)
    if not measurements:
        raise ValueError(f"no rows the model predicts in {', '.join(args.measured)}")
    rows = [fitting.FitRow(m, fitting.predict_measurement(top, m)) for m in measurements]
    print(f"# a2a.sim predict: {top.name}, check {top.check}, {len(rows)} measured rows (medians over the files)")
    for line in [f"#   skipped {line}" for line in skipped] + rows_lines(rows):
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"topology": top.parameters(), "skipped": skipped, **rows_record(rows)}, fh, indent=1)
            fh.write("\n")
    return 0


def _load(files: list[str]) -> tuple[list[fitting.Measurement], list[str]]:
    """The rows of `files`, one per call (the median of its runs), and the lines of the rows skipped."""
    measurements, skipped = [], []
    for path in files:
        found, why = fitting.load_measurements(path)
        measurements += found
        skipped += why
    return fitting.median_rows(measurements), skipped


# ---------------------------------------------------------------------------
# fit


def _fit(args: argparse.Namespace) -> int:
    start = presets.preset(args.preset)
    if args.check:
        start = start.replace(check=args.check)
    measurements, skipped = _load(args.files)
    names = [n.strip() for n in args.fit.split(",") if n.strip()] if args.fit else list(
        presets.FIT_PARAMETERS.get(start.name, FITTABLE))
    scale = presets.FIT_OUTLIER_SCALE.get(start.name, 0.0) if args.outlier_scale is None else args.outlier_scale
    result = fitting.fit(start, measurements, names, ratio_weight=args.ratio_weight, outlier_scale=scale)
    for line in report_lines(result, skipped):
        print(line)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"format": FILE_FORMAT, "topology": result.topology.parameters(),
                       "files": list(args.files), "rms_error": result.rms_error}, fh, indent=1)
            fh.write("\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report_record(result, skipped), fh, indent=1)
            fh.write("\n")
    return 0


def report_lines(result: fitting.FitResult, skipped: list[str]) -> list[str]:
    top = result.topology
    head = (f"# a2a.sim fit: preset {top.name}, {len(result.rows)} rows (medians over the files), "
            f"{result.iterations} iterations")
    lines = [head]
    lines += [f"#   skipped {line}" for line in skipped]
    lines.append("# fitted: " + ", ".join(f"{name}={getattr(top, name):.4g}" for name in result.fitted))
    if result.kept:
        lines.append("# kept (the rows do not depend on them): " + ", ".join(result.kept))
    return lines + rows_lines(result.rows)


def rows_lines(rows: list[fitting.FitRow]) -> list[str]:
    """Each row measured and predicted, the error, the ratios linear / 2dh and where the faster changes."""
    lines = [f"# {'row':<38} {'measured(us)':>12} {'predicted(us)':>13} {'error':>7}  predicted phases (us)"]
    for row in rows:
        phases = " ".join(f"{p.name} {p.time_s * 1e6:.4g}" for p in row.predicted.phases)
        lines.append(f"  {row.measurement.label:<38} {row.measurement.time_s * 1e6:>12.1f} "
                     f"{row.predicted.time_s * 1e6:>13.1f} {row.error:>+7.1%}  {phases}")
    errors = [abs(row.error) for row in rows]
    lines.append(f"# error: rms {math.sqrt(sum(e * e for e in errors) / len(errors)):.1%}, max {max(errors):.1%}")
    ratios = fitting.ratio_rows(rows)
    if ratios:
        lines.append(f"# linear / 2dh: {'shape':<24} {'size':>6} {'measured':>9} {'predicted':>9} {'error':>7}")
        for r in ratios:
            lines.append(f"#               {_shape(r):<24} {fitting._bytes(r['size']):>6} "
                         f"{r['measured']:>9.3f} {r['predicted']:>9.3f} {r['error']:>+7.1%}")
    crossovers = fitting.size_crossovers(rows)
    if crossovers:
        lines.append(f"# the faster changes from: {'shape':<24} {'measured':>9} {'predicted':>9} {'sizes apart':>11}")
        for c in crossovers:
            measured, predicted = (fitting._bytes(c[k]) if c[k] else "never" for k in ("measured", "predicted"))
            lines.append(f"#                          {_shape(c):<24} {measured:>9} {predicted:>9} {c['steps']:>11}")
    return lines


def _shape(record: dict[str, Any]) -> str:
    link = f" {record['link']}" if record["link"] else ""
    return f"{record['nodes']}x{record['local_size']}{link}" + (" unchecked" if record["check"] == "none" else "")


def rows_record(rows: list[fitting.FitRow]) -> dict[str, Any]:
    return {"rows": [{"row": r.measurement.label, "measured_s": r.measurement.time_s,
                      "predicted_s": r.predicted.time_s, "error": r.error,
                      "phases": r.predicted.phase_times()} for r in rows],
            "ratios": fitting.ratio_rows(rows), "crossovers": fitting.size_crossovers(rows)}


def report_record(result: fitting.FitResult, skipped: list[str]) -> dict[str, Any]:
    return {"topology": result.topology.parameters(), "fitted": list(result.fitted), "kept": list(result.kept),
            "rms_error": result.rms_error, "max_error": result.max_error, "skipped": skipped,
            **rows_record(result.rows)}


if __name__ == "__main__":
    sys.exit(main())
