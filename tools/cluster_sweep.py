#!/usr/bin/env python3
"""The 2DH-against-linear sweep on the namespace cluster (issue 25): runs
``python -m a2a.bench --cluster NxL --rate R`` over node counts, ranks per
node, link rates and sizes, with the cross-rank check on and off, and keeps
every run's JSON rows; ``report`` prints where 2DH beats linear per rate
and shape, then each shape's times per size (markdown). Root (a2a.cluster).

    python tools/cluster_sweep.py run [--out build/cluster-sweep] [--rates unshaped,10gbit,1gbit]
                                      [--shapes 2x2,2x4,4x2,4x4,8x2,8x4]
    python tools/cluster_sweep.py report [--out build/cluster-sweep]

Each shape runs two passes (the bench takes one iteration count for a run):
sizes 1K-256K with 20 calls x 5 repetitions, then 1M up to the shape's
largest with 3 calls x 3 repetitions. The largest is 64M, or 16M from 32
ranks on (every rank's buffers of the three cases, at 64M, would not fit in
this host's 24 GiB). Small sizes also run with A2A_CROSS_CHECK=0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from a2a.bench.common import size_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ("1K", "256K", ["-n", "20", "-w", "5", "-r", "5"])
LARGE = ("1M", None, ["-n", "3", "-w", "1", "-r", "3"])


def largest(nodes: int, local: int) -> str:
    return "16M" if nodes * local >= 32 else "64M"


def runs(rates: list[str], shapes: list[tuple[int, int]]):
    """(name, env, bench argv) of every run, in order."""
    for rate in rates:
        for nodes, local in shapes:
            shape = f"{nodes}x{local}"
            base = ["--cluster", shape, "--algo", "linear,2dh", "-f", "4"]
            if rate != "unshaped":
                base += ["--rate", rate]
            for check in ("1", "0"):
                yield (f"{rate}_{shape}_small_check{check}", {"A2A_CROSS_CHECK": check},
                       base + ["-b", SMALL[0], "-e", SMALL[1], *SMALL[2]])
            yield (f"{rate}_{shape}_large_check1", {"A2A_CROSS_CHECK": "1"},
                   base + ["-b", LARGE[0], "-e", largest(nodes, local), *LARGE[2]])


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    failed = 0
    for name, env, argv in runs(args.rates.split(","), shapes):
        path = os.path.join(args.out, name + ".json")
        if os.path.exists(path) and not args.again:
            continue
        start = time.monotonic()
        command = [sys.executable, "-m", "a2a.bench", *argv, "--json", path]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                              check=False)
        seconds = time.monotonic() - start
        print(f"{name}: rc {done.returncode} in {seconds:.0f} s", flush=True)
        if done.returncode != 0:
            failed += 1
            print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
    return 1 if failed else 0


def load(out: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path) as src:
            rows += json.load(src)
    return rows


def table(rows: list[dict]) -> dict:
    """(link, nodes, local) -> size -> {column: seconds}: linear, 2dh, linear-unchecked, 2dh-unchecked
    (the unchecked ones measured in a run of their own, A2A_CROSS_CHECK=0), mpi."""
    out: dict = {}
    for row in rows:
        key = (row["link"], row["num_nodes"], row["local_size"])
        checked = row.get("cross_check", True)
        if row["algo"] == "mpi" and not checked:
            continue  # the baseline of the unchecked run: the checked run has one
        column = row["algo"] + ("" if checked else "-unchecked")
        out.setdefault(key, {}).setdefault(row["size"], {})[column] = row["time_us"] * 1e-6
    return out


ORDER = {"unshaped": 0, "10gbit": 1, "1gbit": 2}
WIN = 0.95  # a win: at least 5% faster (one run on a shared host: ties are noise)


def keys(data: dict) -> list:
    return sorted(data, key=lambda k: (ORDER.get(k[0], 9), k[1] * k[2], k[1]))


def summary(data: dict) -> None:
    """Per rate and shape: the sizes at which 2DH beats linear, checked and unchecked."""
    print("| link | nodes x ranks | 2DH >= 5% faster than linear at | unchecked: 2DH >= 5% faster at | "
          "unchecked: 2DH / linear at 1K |")
    print("|---|---|---|---|---|")
    for key in keys(data):
        link, nodes, local = key
        cells = data[key]
        first = cells.get(1024, {})
        ratio = f"{first['2dh-unchecked'] / first['linear-unchecked']:.2f}" if "2dh-unchecked" in first else "-"
        print(f"| {link} | {nodes} x {local} | {wins(cells, '2dh', 'linear')} | "
              f"{wins(cells, '2dh-unchecked', 'linear-unchecked')} | {ratio} |")


def wins(cells: dict, column: str, against: str) -> str:
    """The sizes at which `column` beats `against` (measured in the same run) by WIN."""
    won = [size_text(size) for size in sorted(cells) if column in cells[size] and against in cells[size]
           and cells[size][column] < WIN * cells[size][against]]
    return ", ".join(won) or "nowhere"


def report(args: argparse.Namespace) -> int:
    data = table(load(args.out))
    if not data:
        print(f"no rows in {args.out}", file=sys.stderr)
        return 1
    summary(data)
    columns = ["linear", "2dh", "linear-unchecked", "2dh-unchecked", "mpi"]
    for key in keys(data):
        link, nodes, local = key
        print(f"\n{link}, {nodes} nodes x {local} ranks (time in us; 2dh/linear < 1: 2DH wins)\n")
        print("| size | " + " | ".join(columns) + " | 2dh / linear | unchecked: 2dh / linear |")
        print("|---" * (len(columns) + 3) + "|")
        for size in sorted(data[key]):
            cell = data[key][size]
            times = [f"{cell[c] * 1e6:.1f}" if c in cell else "-" for c in columns]
            ratio = [f"{cell[c] / cell[base]:.2f}" if c in cell and base in cell else "-"
                     for c, base in (("2dh", "linear"), ("2dh-unchecked", "linear-unchecked"))]
            print(f"| {size_text(size)} | " + " | ".join(times) + " | " + " | ".join(ratio) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/cluster_sweep.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    p_run = sub.add_parser("run", help="run the sweep (skips runs whose JSON exists unless --again)")
    p_run.add_argument("--rates", default="unshaped,10gbit,1gbit")
    p_run.add_argument("--shapes", default="2x2,2x4,4x2,4x4,8x2,8x4")
    p_run.add_argument("--again", action="store_true")
    p_rep = sub.add_parser("report", help="where 2DH wins, then every shape's table, as markdown")
    for q in (p_run, p_rep):
        q.add_argument("--out", default=os.path.join(ROOT, "build", "cluster-sweep"))
    args = p.parse_args(argv)
    return run(args) if args.verb == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
