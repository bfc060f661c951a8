#!/usr/bin/env python3
"""Extract tests/data/sim_cluster/ from a tools/cluster_sweep.py run: one file
per RATE_NxL with the fields a2a.sim reads (algo, size, time_us cut to
0.1, ranks, local_size, num_nodes, link, cross_check), the baseline rows
(mpi) dropped; rows by check (on first), size, algo. a2a.sim's tests and
presets (docs/scaling.md) are fitted on what this writes.

    python tools/sim_cluster_data.py SWEEP_DIR [--to tests/data/sim_cluster] [--note TEXT]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("algo", "size", "time_us", "ranks", "local_size", "num_nodes", "link", "cross_check")
NAME = re.compile(r"^(?P<group>[^_]+_\d+x\d+)_(small|large)_check(?P<check>[01])\.json$")


def extract(sweep: str, to: str, note: str) -> list[str]:
    groups: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(sweep, "*_check*.json"))):
        match = NAME.match(os.path.basename(path))
        if match:
            groups.setdefault(match["group"], []).append(path)
    os.makedirs(to, exist_ok=True)
    written = []
    for group, paths in sorted(groups.items()):
        commands, rows = [], []
        for path in paths:  # sorted by name: large_check1, small_check0, small_check1
            check = NAME.match(os.path.basename(path))["check"]
            with open(path, encoding="utf-8") as src:
                found = [r for r in json.load(src) if not r.get("baseline") and r["algo"] != "mpi"]
            command = found[0]["command"].replace(f"--json {path}", "--json F")
            commands.append(f"A2A_CROSS_CHECK={check} {command}")
            rows += [{k: math.floor(r[k] * 10) / 10 if k == "time_us" else r[k] for k in FIELDS} for r in found]
        rows.sort(key=lambda r: (not r["cross_check"], r["size"], r["algo"]))
        lines = [json.dumps(r) for r in rows]
        text = (f'{{"measured": {json.dumps(note + "; each run: " + "; ".join(commands))},\n "rows": [\n  '
                + ",\n  ".join(lines) + "\n ]}\n")
        out = os.path.join(to, group + ".json")
        with open(out, "w", encoding="utf-8") as dst:
            dst.write(text)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="the --out of tools/cluster_sweep.py run")
    p.add_argument("--to", default=os.path.join(ROOT, "tests", "data", "sim_cluster"))
    p.add_argument("--note", default="python tools/cluster_sweep.py run (issue 25)",
                   help="what the files' \"measured\" field says before the runs' commands")
    args = p.parse_args(argv)
    for path in extract(args.sweep, args.to, args.note):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
