"""The general path's known gaps against their targets: ``python -m a2a.bench --gaps``.

    python -m a2a.bench --gaps [--np 4] [--local-size 2] [-r 9] [-n 20] [--json F]

Under mpirun (started plainly it relaunches itself on ``--np`` ranks, 4 by
default, emulated as nodes of 2: the "4 ranks as 2 x 2" these targets were
set on, issue 26). Each gap is a case of the collectives sweep
(:mod:`a2a.bench.collectives`) timed in turns with the case it is measured
against, float32, medians of ``-r`` repetitions of ``-n`` calls:

========================  ==========================  ===================  ===========
gap                       ours                        against              target
========================  ==========================  ===================  ===========
small linear              linear, 8, 16, 32, 64 KiB   MPI_Alltoall         time <= 1.2x
small v                   v (counts every call), 8,   MPI_Alltoall         time <= 1.5x
                          64 KiB
v throughput              v at 1 MiB                  linear               busbw >= 0.8x
flex combine, M = 256     combine at 16 MiB           linear               busbw >= 0.9x
flex dispatch, M = 256    flex at 16 MiB              linear               busbw >= 0.9x
========================  ==========================  ===================  ===========

Each row prints both times, the ratio, the target and whether it is met,
so a gap stays visible in every run; ``#wrong`` checks every case once
(exit status 1 if any element is wrong). Sizes are what each rank sends.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from . import collectives, common
from .collectives_baselines import BASELINE
from .collectives_data import DTYPES

__all__ = ["GAPS", "is_gaps_mode", "main", "parse_args"]

FLAG = "--gaps"
DEFAULT_NP = 4
DEFAULT_LOCAL_SIZE = 2
KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Gap:
    name: str
    algo: str  # ours: a case of the collectives sweep
    against: str  # the case it is measured against
    sizes: tuple[int, ...]  # bytes per rank
    time_ratio: bool  # True: ours' time / theirs' (at most target); False: busbw ratio (at least target)
    target: float
    hidden: int = 1024  # flex's M


GAPS = (
    Gap("small linear", "linear", BASELINE, (8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB), True, 1.2),
    Gap("small v", "v", BASELINE, (8 * KIB, 64 * KIB), True, 1.5),
    Gap("v throughput", "v", "linear", (MIB,), False, 0.8),
    Gap("flex combine, M = 256", "combine", "linear", (16 * MIB,), False, 0.9, hidden=256),
    Gap("flex dispatch, M = 256", "flex", "linear", (16 * MIB,), False, 0.9, hidden=256),
)


def is_gaps_mode(argv: list[str]) -> bool:
    return FLAG in argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.bench --gaps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument(FLAG, action="store_true", required=True, help="this benchmark")
    p.add_argument("--np", type=int, help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})")
    p.add_argument("--local-size", type=int, help=f"emulated ranks per node (default {DEFAULT_LOCAL_SIZE})")
    common.add_timing_flags(p, iters=20, repeats=9, warmup=5)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE (rank 0)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    common.require_at_least(parser, (("-r/--repeats", args.repeats, 1), ("-n/--iters", args.iters, 1),
                                     ("-w/--warmup_iters", args.warmup_iters, 0)))
    if args.np is not None and args.np < 2:
        parser.error(f"--np must be at least 2 (the gaps are exchanges), got {args.np}")
    return args


def main(argv: list[str] | None = None) -> int:
    from a2a import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not launch.under_mpirun():
        return common.relaunch("a2a.bench", argv, args.np, args.local_size, default_np=DEFAULT_NP,
                               default_local_size=DEFAULT_LOCAL_SIZE)
    return common.on_every_rank(lambda: _bench(args, argv))


def _sweep_args(args: argparse.Namespace, gap: Gap) -> argparse.Namespace:
    """The collectives sweep's arguments for one gap's cases."""
    return collectives.parse_args(["-d", "float", "--no-baseline", "--hidden", str(gap.hidden), "-n",
                                   str(args.iters), "-r", str(args.repeats), "-w", str(args.warmup_iters)])


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from mpi4py import MPI

    import a2a

    world = MPI.COMM_WORLD
    comm = a2a.Comm.from_mpi(world, local_size=args.local_size)
    lead = comm.rank == 0
    if lead:
        print(f"# a2a.bench --gaps: {comm.size} ranks = {comm.num_nodes} node(s) x {comm.local_size}; float32; "
              f"medians of {args.repeats} x {args.iters} calls, in turns; command: {common.command_line(argv)}")
        print(f"# {'gap':<24s} {'size':>8s} {'ours':>8s} {'us':>10s} {'against':>8s} {'us':>10s} "
              f"{'ratio':>7s} {'target':>9s}  met  #wrong")
    rows: list[dict[str, Any]] = []
    wrong_total = 0
    dtype = DTYPES["float"]
    for gap in GAPS:
        sweep = _sweep_args(args, gap)
        for size in gap.sizes:
            cases = [collectives._make_case(algo, size, dtype, comm, sweep) for algo in (gap.algo, gap.against)]
            ours, theirs = collectives._measure_group(cases, sweep)
            wrong = sum(collectives._check(case, sweep) or 0 for case in cases)
            ratio = ours / theirs if gap.time_ratio else (cases[0].size / ours) / (cases[1].size / theirs)
            met = ratio <= gap.target if gap.time_ratio else ratio >= gap.target
            wrong_total += wrong
            row = {"gap": gap.name, "size": cases[0].size, "algo": gap.algo, "time_us": ours * 1e6,
                   "against": gap.against, "against_time_us": theirs * 1e6, "ratio": ratio,
                   "ratio_of": "time" if gap.time_ratio else "busbw", "target": gap.target, "met": met,
                   "wrong": wrong, "ranks": comm.size, "local_size": comm.local_size, "hidden": gap.hidden}
            rows.append(row)
            if lead:
                target = f"{'<=' if gap.time_ratio else '>='} {gap.target:g}"
                print(f"  {gap.name:<24s} {common.size_text(cases[0].size):>8s} {gap.algo:>8s} {ours * 1e6:10.2f} "
                      f"{gap.against:>8s} {theirs * 1e6:10.2f} {ratio:6.2f}x {target:>9s}  {'yes' if met else 'NO':>3s}"
                      f"  {wrong}", flush=True)
            del cases
    if lead:
        met = sum(row["met"] for row in rows)
        print(f"# {met} of {len(rows)} rows meet their target; median ratio per gap: " + ", ".join(
            f"{gap.name} {statistics.median(r['ratio'] for r in rows if r['gap'] == gap.name):.2f}" for gap in GAPS))
        if args.json:
            common.write_json(args.json, rows)
    return 1 if wrong_total else 0
