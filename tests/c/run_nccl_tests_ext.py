"""Builds nccl_tests_ext/ against the installed liba2a via find_package(a2a),
runs its data-check test, then runs alltoall_perf, alltoallv_perf and
alltoall_flex_perf under mpirun on 2 ranks, 3 ranks and 4 ranks as 2 emulated
nodes of 2, with -c 1, and reads their output with a2a.nccl_format:
every row checked (#wrong 0), sizes as documented, the footer OK. Also: flags
that do not apply are rejected with their reason, -D cuda runs or fails with a
clear message, and python -m a2a.bench reports the same sizes.

    python tests/c/run_nccl_tests_ext.py            # what `make test` runs
    python tests/c/run_nccl_tests_ext.py --build-only  # `make nccl-tests-ext`
    python tests/c/run_nccl_tests_ext.py --build-only --build-dir DIR  # elsewhere (tools/gpu_check)

Prints one PASS/FAIL line per run and a summary; exits 1 on any failure."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from c_programs import cmake_build, mpirun_env

from a2a.launch import mpirun_command
from a2a.nccl_format import Report, parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "nccl_tests_ext")
BUILD = os.path.join(ROOT, "build", "nccl-tests-ext")
SIZES = ["-b", "1K", "-e", "64K", "-f", "4"]  # 1K, 4K, 16K, 64K per rank
FAST = ["-n", "5", "-w", "1", "-c", "1"]
ITEMSIZE = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2, "float": 4,
            "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}


@dataclass(frozen=True)
class Run:
    program: str
    ranks: int
    local_size: int | None
    args: tuple[str, ...]

    @property
    def label(self) -> str:
        where = f"{self.ranks} ranks" + (f" as {self.ranks // self.local_size} x {self.local_size}" if self.local_size else "")
        return f"{self.program} {' '.join(self.args)} ({where})"


# Every program at 2 ranks, 3 ranks and 2 x 2; between them every option
# that changes the data layout, and every datatype once.
RUNS = [
    Run("alltoall_perf", 2, None, (*SIZES, "-a", "linear")),
    Run("alltoall_perf", 3, None, ("-b", "4K", "-e", "4K", "-d", "all")),
    Run("alltoall_perf", 4, 2, (*SIZES, "-a", "2dh", "-u", "1")),
    Run("alltoallv_perf", 2, None, (*SIZES, "-s", "1")),
    Run("alltoallv_perf", 3, None, (*SIZES, "-s", "2", "--seed", "7", "-P", "1", "-d", "half")),
    Run("alltoallv_perf", 4, 2, (*SIZES, "-a", "2dh", "-s", "1.5")),
    Run("alltoall_flex_perf", 2, None, (*SIZES, "-L", "dispatch")),
    Run("alltoall_flex_perf", 3, None, (*SIZES, "-L", "combine", "-E", "3", "-H", "64", "-d", "double")),
    Run("alltoall_flex_perf", 4, 2, (*SIZES, "-a", "2dh", "-L", "dispatch", "-H", "32")),
    Run("alltoall_flex_perf", 4, 2, (*SIZES, "-a", "2dh", "-L", "combine", "-z", "3")),
]


def build() -> None:
    cmake_build(SOURCE, BUILD, "--parallel", "2")


def launch(program: str, ranks: int, local_size: int | None, args: list[str]) -> subprocess.CompletedProcess:
    command = mpirun_command(ranks, [os.path.join(BUILD, program), *args])
    return subprocess.run(command, env=mpirun_env(local_size), capture_output=True, text=True, timeout=300,
                          check=False)


def expected_sizes(args: tuple[str, ...]) -> list[int]:
    """The requested sizes of -b/-e/-f (K suffixes only, as used here)."""
    def value(flag: str, default: str) -> int:
        text = args[args.index(flag) + 1] if flag in args else default
        return int(text[:-1]) * 1024 if text.endswith("K") else int(text)

    low, high, factor = value("-b", "32M"), value("-e", "32M"), value("-f", "1")
    sizes = [low]
    while sizes[-1] * factor <= high and factor > 1:
        sizes.append(sizes[-1] * factor)
    return sizes


def problems_of(run: Run, report: Report) -> list[str]:
    """What is wrong with one run's parsed output."""
    found = []
    if report.program != run.program:
        found.append(f"program {report.program!r}")
    if len(report.devices) != run.ranks or any(d.device != "cpu" for d in report.devices):
        found.append(f"device lines {report.devices}")
    if report.other_lines:
        found.append(f"unparsed lines {report.other_lines}")
    types = [t for t in ITEMSIZE] if "all" in run.args else [run.args[run.args.index("-d") + 1] if "-d" in run.args else "float"]
    requested = expected_sizes(run.args)
    if [(r.type, r.redop, r.root) for r in report.rows] != [(t, "none", -1) for t in types for _ in requested]:
        found.append(f"rows {[(r.type, r.size) for r in report.rows]}, expected {len(requested)} per type {types}")
    for row, want in zip(report.rows, [(t, s) for t in types for s in requested]):
        item = ITEMSIZE[row.type]
        group = row.out_of_place
        if group is None or row.in_place is not None or row.extra:
            found.append(f"row {row}: expected the out-of-place group alone")
            continue
        if group.wrong != 0:
            found.append(f"row of {row.size} B: #wrong {group.wrong}")
        # size = what each rank sends: count elements to each of the ranks, never above the request.
        if row.size != row.count * run.ranks * item or not 0 < row.size <= want[1]:
            found.append(f"row of {row.size} B: count {row.count} x {run.ranks} ranks x {item} B, requested {want[1]}")
        if run.program != "alltoallv_perf" and abs(group.busbw - group.algbw * (run.ranks - 1) / run.ranks) > 0.011:
            found.append(f"row of {row.size} B: busbw {group.busbw} is not algbw x (n-1)/n")
    if report.out_of_bounds != 0 or report.out_of_bounds_ok is not True:
        found.append(f"out of bounds {report.out_of_bounds} {report.out_of_bounds_ok}")
    busbws = [r.out_of_place.busbw for r in report.rows if r.out_of_place]
    if report.avg_bus_bandwidth is None or not busbws or abs(report.avg_bus_bandwidth - sum(busbws) / len(busbws)) > 0.01:
        found.append(f"avg bus bandwidth {report.avg_bus_bandwidth} against rows {busbws}")
    return found


def run_and_check(run: Run) -> list[str]:
    done = launch(run.program, run.ranks, run.local_size, [*run.args, *FAST])
    if done.returncode != 0:
        return [f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"]
    found = problems_of(run, parse(done.stdout))
    return found + ([done.stdout] if found else [])


def rejections() -> list[str]:
    """Flags that cannot apply fail at once, on every rank, naming the flag and why."""
    found = []
    for args, words in ((["-o", "sum"], "no reduction"), (["-r", "1"], "no root"), (["-a", "1"], "--average"),
                        (["-g", "2"], "one GPU per rank"), (["-G", "1"], "needs -D cuda"), (["-b", "1X"], "minbytes")):
        done = launch("alltoall_perf", 2, None, args)
        if done.returncode == 0 or words not in done.stderr:
            found.append(f"{' '.join(args)}: exit {done.returncode}, stderr {done.stderr!r}")
    done = launch("alltoallv_perf", 2, None, ["-D", "cuda", "-G", "1"])
    if done.returncode == 0 or "cannot capture" not in done.stderr:
        found.append(f"alltoallv_perf -G: exit {done.returncode}, stderr {done.stderr!r}")
    return found


def cuda_buffers() -> list[str]:
    """-D cuda on one rank: correct where a GPU and NCCL are, else a clear refusal."""
    done = launch("alltoall_perf", 1, None, ["-D", "cuda", "-b", "64K", "-e", "64K", *FAST])
    if done.returncode == 0:
        report = parse(done.stdout)
        ok = report.out_of_bounds == 0 and len(report.rows) == 1 and report.devices[0].device == "0"
        return [] if ok else [f"-D cuda ran but its output is wrong:\n{done.stdout}"]
    if "-D cuda" not in done.stderr:
        return [f"-D cuda failed without saying why: exit {done.returncode}, stderr {done.stderr!r}"]
    print(f"  (-D cuda here: {done.stderr.strip().splitlines()[0]})")
    return []


def same_sizes_as_python_bench() -> list[str]:
    """alltoall_perf and python -m a2a.bench report rows of the same sizes."""
    ours = launch("alltoall_perf", 4, 2, [*SIZES, *FAST])
    env = dict(os.environ, A2A_TIMEOUT_S="60")
    bench = [sys.executable, "-m", "a2a.bench", "--np", "4", "--local-size", "2", "--algo", "linear", *SIZES,
             "-n", "5", "-w", "1", "-r", "1", "--no-baseline"]
    theirs = subprocess.run(bench, env=env, capture_output=True, text=True, timeout=300, check=False)
    if ours.returncode or theirs.returncode:
        return [f"exit codes {ours.returncode}, {theirs.returncode}: {ours.stderr} {theirs.stderr}"]
    mine, python = parse(ours.stdout), parse(theirs.stdout)
    sizes = [r.size for r in mine.rows], [r.size for r in python.rows]
    wrong = [r.out_of_place.wrong for r in python.rows if r.out_of_place]
    if sizes[0] != sizes[1] or not sizes[0] or any(wrong) or [r.extra[0] for r in python.rows] != ["linear"] * len(sizes[1]):
        return [f"sizes {sizes[0]} (alltoall_perf) and {sizes[1]} (a2a.bench), a2a.bench #wrong {wrong}"]
    return []


def main() -> int:
    global BUILD
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-only", action="store_true", help="build the programs and stop")
    parser.add_argument("--build-dir", default=BUILD, help=f"where to build them (default {BUILD})")
    args = parser.parse_args()
    BUILD = os.path.abspath(args.build_dir)
    if args.build_only:
        build()
        print(f"built {', '.join(sorted({r.program for r in RUNS}))} in {BUILD}")
        return 0
    build()
    pattern = subprocess.run([os.path.join(BUILD, "pattern_test")], capture_output=True, text=True, check=False)
    results = [("the data check (pattern_test)", [pattern.stdout] if pattern.returncode else [])]
    results += [(run.label, run_and_check(run)) for run in RUNS]
    results += [("flags that do not apply are rejected", rejections()), ("-D cuda", cuda_buffers()),
                ("the same sizes as python -m a2a.bench", same_sizes_as_python_bench())]
    failed = 0
    for label, found in results:
        print(f"{'FAIL' if found else 'PASS'}: {label}")
        for problem in found:
            print("  " + problem.replace("\n", "\n  "))
        failed += bool(found)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
