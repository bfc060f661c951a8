"""The GPU check's driver, started by tools/gpu_check.sh (which passes
--kit and puts tools/ on PYTHONPATH); its other options pass through:

    tools/gpu_check.sh                          # the device machine: build, every stage
    tools/gpu_check.sh --dry-run                # here: up to the first GPU call
    tools/gpu_check.sh --only tests --only bench   # a rerun of some stages
    tools/gpu_check.sh --only bench --step gpu-step   # of some steps (a part of their names)
    tools/gpu_check.sh --list                   # the stages, steps and budgets

Writes into --out (default $OUT, else build/gpu-check): gpu_check.md (the
summary), build.log, one log per stage (1-tests.log .. 5-bench.log) and
bench.json (every benchmark's rows): seven files, as the device tool brings
back at most eight. Exits 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .environment import DEFAULT_ARCH, build, detect_arch, facts, install_kit, prepare
from .report import write
from .stages import (
    BUILD_BUDGET_S,
    DEADLINE_S,
    DRY_BUILD_BUDGET_S,
    NOT_CHOSEN,
    STAGES,
    Result,
    Started,
    finish_step,
    start_step,
)
from .targets import evaluate

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/gpu_check.sh", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--kit", type=Path, help="the folder of carried wheels (make gpu-kit)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: everything up to the first GPU call")
    p.add_argument("--only", action="append", choices=[s.key for s in STAGES],
                   help="run only these stages (the build always runs); repeatable")
    p.add_argument("--step", action="append", metavar="PART",
                   help="run only the steps whose name contains PART (within --only's stages); repeatable")
    p.add_argument("--out", type=Path, help="where the summary and logs go (default $OUT, else build/gpu-check)")
    p.add_argument("--work", type=Path, default=Path("/tmp/a2a-gpu-check"),
                   help="scratch folder, emptied first (default /tmp/a2a-gpu-check)")
    p.add_argument("--arch", help=f"CUDA architecture to build (default: the GPU's; {DEFAULT_ARCH} in a dry run)")
    p.add_argument("--list", action="store_true", help="print the stages, their steps and budgets, and stop")
    args = p.parse_args(argv)
    if not args.list and args.kit is None:
        p.error("--kit is required (tools/gpu_check.sh passes it)")
    return args


def list_stages() -> None:
    print(f"build  {BUILD_BUDGET_S:4d} s  the kit's wheels, a2a for one architecture, nccl_tests_ext")
    for stage in STAGES:
        print(f"{stage.key:<7}{stage.budget_s:4d} s  {stage.title}")
        for step in stage.steps:
            when = " (starts after the build, in the background; the budget is its stage's wait)" if step.early else ""
            print(f"       {step.budget_s:4d} s    {step.name}{when}")
    print(f"deadline {DEADLINE_S} s from the start, everything included")


def chosen(args: argparse.Namespace, stage, step) -> bool:
    """The step is in --only's stages and its name contains a --step part."""
    return ((not args.only or stage.key in args.only)
            and (not args.step or any(part in step.name for part in args.step)))


def run_build(environment, kit: Path, log_path: Path, arch: str | None, dry: bool) -> Result:
    started = time.monotonic()
    budget_s = DRY_BUILD_BUDGET_S if dry else BUILD_BUDGET_S
    deadline = started + budget_s
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            install_kit(environment, kit, log, deadline)
            arch = arch or (DEFAULT_ARCH if dry else detect_arch(environment))
            config = build(environment, arch, log, deadline)
        except RuntimeError as error:
            log.write(f"\nbuild failed: {error}\n")
            log.flush()
            tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
            return Result("build", f"kit, a2a for sm_{arch or '?'}, nccl_tests_ext", "failed",
                          time.monotonic() - started, str(error)[:300], tail, budget_s=budget_s)
    summary = (f"a2a {config['version']}: CUDA sm_{','.join(config['cuda_archs'])}, NCCL {config['nccl_version']}, "
               f"MPI {config['mpi_version']}")
    return Result("build", f"kit, a2a for sm_{arch}, nccl_tests_ext", "passed", time.monotonic() - started, summary,
                  budget_s=budget_s)


def merge_bench_json(bench: Path, into: Path) -> None:
    rows = {path.stem: json.loads(path.read_text()) for path in sorted(bench.glob("*.json"))}
    into.write_text(json.dumps(rows, indent=1) + "\n")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.list:
        list_stages()
        return 0
    started = time.monotonic()
    out = (args.out or Path(os.environ.get("OUT") or ROOT / "build" / "gpu-check")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    environment = prepare(ROOT, args.work.resolve())
    environment.kit = args.kit.resolve()
    mode = "dry run, no GPU call" if args.dry_run else "GPU run"
    print(f"gpu_check: {mode}; work {environment.work}, out {out}, python {environment.interpreter_note}", flush=True)
    built = run_build(environment, args.kit.resolve(), out / "build.log", args.arch, args.dry_run)
    deadline = (time.monotonic() + DEADLINE_S - BUILD_BUDGET_S) if args.dry_run else started + DEADLINE_S
    print(f"{'ok  ' if built.ok else 'FAIL'}  build ({built.seconds:.0f} s): {built.summary}", flush=True)
    for stage in STAGES:
        (out / stage.log).write_text(f"# {stage.key}: {stage.title}\n")
    # The early steps start now, in the background; each is awaited in its stage's turn.
    early = {}
    if built.ok and not args.dry_run:
        for stage in STAGES:
            for step in stage.steps:
                if step.early and chosen(args, stage, step):
                    early[step.name] = start_step(stage, step, environment, out / stage.log, dry=False,
                                                  budget_s=step.budget_s)
    results: list[Result] = []
    for stage in STAGES:
        for step in stage.steps:
            if not chosen(args, stage, step):
                result = Result(stage.key, step.name, NOT_CHOSEN, budget_s=step.budget_s)
            elif not built.ok:
                result = Result(stage.key, step.name, "not run: the build failed", budget_s=step.budget_s)
            else:
                budget = min(step.budget_s, deadline - time.monotonic())
                pending = early.get(step.name) or start_step(stage, step, environment, out / stage.log,
                                                             dry=args.dry_run, budget_s=budget)
                result = finish_step(pending, budget) if isinstance(pending, Started) else pending
            results.append(result)
            word = "ok  " if result.ok else "FAIL"
            print(f"{word}  {stage.key}: {step.name} ({result.seconds:.0f} s): {result.status}; {result.summary}",
                  flush=True)
    targets = evaluate(environment.bench, results, dry=args.dry_run)
    merge_bench_json(environment.bench, out / "bench.json")
    summary = out / "gpu_check.md"
    write(summary, dry=args.dry_run, facts=facts(environment, args.kit.resolve()), build=built, results=results,
          targets=targets, seconds=time.monotonic() - started)
    print(summary.read_text(), flush=True)
    # A step left out on purpose (--only, --step, the dry run's GPU part) is no failure; one the deadline cut is.
    return 0 if all(r.ok for r in [built, *results]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
