"""The stages of the GPU check, each step with its time budget, and the
runner that holds a step to it.

A step that fails or runs over its budget is reported and the next one
still runs (process.Held.wait stops one over budget). The dry run (no GPU) runs each
step's `dry` command instead, the part that needs no GPU call (collection,
argument parsing, the carried mpirun), or nothing.

Budgets, in seconds, for an H100 machine of the lent kind (16 cores): the
build is measured (docs/gpu.md, "First contact"), the rest estimated from
the CPU runs and the case counts; they add up to DEADLINE_S, the issue's 8
minutes, and a step starts with what is left of that, at most its budget.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .environment import Environment
from .process import Held, start_held

DEADLINE_S = 480  # from the start of the driver: kit, build and every stage (the 8 minutes)
BUILD_BUDGET_S = 62  # the kit, a2a for one architecture, nccl_tests_ext (see docs/gpu.md, "First contact")
# The dry run builds on the development machine (2 cores, about 2 minutes) and
# its steps only collect and parse: its deadline counts from the build's end.
DRY_BUILD_BUDGET_S = 900
NO_GPU = "not run: no GPU"
DRY_PASSED = f"{NO_GPU}; its dry part passed"
NOT_CHOSEN = "not run: not chosen (--only, --step)"

Command = Callable[[Environment], list[str]]


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    command: Command
    dry: Command | None = None  # what the dry run runs instead (the command itself: it needs no GPU); None: nothing
    # Started in the background as soon as the build is done (CPU work that needs no GPU, such as a
    # compile); its stage then waits for it, at most budget_s.
    early: bool = False


@dataclass(frozen=True)
class Stage:
    key: str  # for --only
    title: str
    log: str  # file name under the output folder
    steps: tuple[Step, ...]

    @property
    def budget_s(self) -> int:
        return sum(step.budget_s for step in self.steps)


@dataclass
class Result:
    stage: str
    step: str
    status: str  # passed, failed (exit N), over budget (N s), not run: why (the dry run: NO_GPU + its dry part)
    seconds: float = 0.0
    summary: str = ""  # the command's own last word (pytest's summary line, a runner's count)
    excerpt: str = ""  # the lines to read first when it did not pass
    skips: list[str] = field(default_factory=list)  # pytest's SKIPPED lines: on a GPU, each is a finding
    output: str = ""  # the step's whole output (the targets read the benchmarks' tables from it)
    budget_s: float = 0.0  # what it was given (less than its Step's budget when the deadline was near)

    @property
    def ok(self) -> bool:
        """Passed, or (the dry run) its dry part passed or it has none, or left out by --only."""
        return self.status in ("passed", NO_GPU, DRY_PASSED, NOT_CHOSEN)


def pytest(*paths: str, ignore: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> Command:
    """pytest on paths of the checkout, quiet, with the reasons of failures,
    errors and skips; no cache written into the checkout."""
    def command(e: Environment) -> list[str]:
        return [e.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--rootdir", str(e.root),
                *(str(e.root / p) for p in paths), *(f"--ignore={e.root / p}" for p in ignore), *extra]
    return command


def collect(test: Command) -> Command:
    return lambda e: [*test(e), "--collect-only"]


def python_module(module: str, *args: str) -> Command:
    return lambda e: [e.python, "-m", module, *(a.format(bench=e.bench, work=e.work) for a in args)]


def parse_only(module: str, *args: str) -> Command:
    """The benchmark's own parser on the arguments of the GPU run: nothing runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    return lambda e: [e.python, os.path.join(here, "parse_only.py"), module,
                      *(a.format(bench=e.bench, work=e.work) for a in args)]


def nccl_perf(program: str, *args: str) -> Command:
    return lambda e: [e.python, "-m", "a2a.launch", "--np", "1", "--", str(e.nccl_tests / program), *args]


def nccl_help(program: str, *args: str) -> Command:
    """The program parses the flags of the GPU run up to a final --help, which
    stops it before any device call (its MPI is the kit's)."""
    return lambda e: [*nccl_perf(program, *args)(e), "--help"]


KIT_MPIRUN_CODE = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
              "assert c.allreduce(1) == c.size == 2, c.allreduce(1); "
              "import re; maps = open('/proc/self/maps').read(); "
              "print(c.rank, 'libmpi:', sorted(set(re.findall(r'/\\S+/libmpi\\.so\\S*', maps))))")

KIT_MPIRUN: Command = lambda e: [e.python, "-m", "a2a.launch", "--np", "2", "--", e.python, "-c",
                                 KIT_MPIRUN_CODE]
# One line per test (-v twice past -q), so that a test that hangs is named by the last line before the
# stacks tests/gpu/conftest.py dumps (A2A_TEST_HANG_S, set by environment.py); a failure's traceback is
# written when it fails. Three steps, so that one of them stuck still leaves the others' results.
VERBOSE = ("-v", "-v")
GPU_KERNEL_TESTS = pytest("tests/gpu/test_collectives_gpu.py", "tests/gpu/test_es_ops_gpu.py",
                          "tests/gpu/test_layout_gpu.py", "tests/gpu/test_moe_gpu.py", "tests/gpu/test_gate_gpu.py",
                          extra=VERBOSE)
GPU_FP8_TESTS = pytest("tests/gpu/test_fp8_gpu.py", extra=VERBOSE)
GPU_LAYER_TESTS = pytest("tests/gpu/test_layer_graphs_gpu.py", "tests/gpu/test_runtime_gpu.py",
                         "tests/gpu/test_tutel_gpu.py", extra=VERBOSE)
UNIT_CUDA = pytest("tests/unit/test_moe_devices.py", "tests/unit/test_torch_collectives.py",
                   "tests/unit/test_expert_cache.py", "tests/unit/test_layout.py", extra=("-k", "cuda"))
STAGED = pytest("tests/gpu/test_staged_mpi_gpu.py")
NCCL_GROUP = pytest("tests/gpu/test_nccl_group_gpu.py")
RUNTIME: Command = lambda e: [e.python, str(e.root / "tests" / "run_mpi.py"), "--gpu"]
PEERS: Command = lambda e: [e.python, str(e.root / "tools" / "gpu_check" / "install_peers.py"), str(e.kit),
                            str(e.prefix), str(e.work)]

# The benchmarks: sizes chosen to finish inside the budget on an H100 and to
# cover each target's range (docs/benchmarks.md, "GPU checks").
COLLECTIVES_ARGS = ("--device", "cuda", "-b", "1K", "-e", "64M", "-f", "8", "--algo", "linear,2dh,flex,v",
                    "-n", "20", "-w", "3", "--json", "{bench}/collectives.json")
LAYOUT_ARGS = ("--layout", "--device", "cuda", "--total", "128M", "--chunks", "4K,64K,256K,1M,4M", "-n", "10",
               "-r", "5", "--json", "{bench}/layout.json")
KERNEL_ARGS = ("--op", "all", "--device", "cuda", "--dtype", "bfloat16", "--tokens", "16384", "--experts", "64",
               "--model-dim", "1024,4096", "--top-k", "2", "-r", "3", "--json", "{bench}/kernels.json")
ES_ARGS = ("--op", "esmm,ess,estmm", "--device", "cuda", "--tokens", "16384", "--experts", "8", "--top-k", "2",
           "--model-dim", "1024", "--hidden", "1024", "--dtype", "bfloat16,float32", "-r", "5", "--profile", "6",
           "--json", "{bench}/es_ops.json")  # --profile: which kernels hold esmm's time (0.10x cuBLAS in bf16)
FP8_ARGS = ("--op", "quantize_fp8,dequantize_fp8", "--device", "cuda", "--rows", "16384", "--model-dim", "1024,7168",
            "-r", "5", "--json", "{bench}/fp8.json")
GATE_ARGS = ("--op", "top_k_gate", "--device", "cuda", "--tokens", "16384", "--experts", "8,64,256", "--top-k", "2,8",
             "-r", "3", "--json", "{bench}/gate.json")
# T = 4096 and 16384, M = H = 1024, E = 8, k = 2, f = 1, bf16, 1 rank: ours (eager, graphed, captured whole),
# Tutel, Megatron-Core, GShard
LAYER_ARGS = ("--gpu-step", "--json", "{bench}/layer.json")
NCCL_ARGS = ("-D", "cuda", "-b", "1K", "-e", "64M", "-f", "8", "-n", "20", "-w", "5", "-c", "1")

# Budgets: the H200 runs of 2026-11-29 and 2026-11-30 (docs/benchmarks.md) took 38-55 s to build; 25 s
# for the kernel tests alone and 35+ s beside the peers' install (59% done at 35 s); about 10 s for
# FP8's; 27 s for the graphed layer's, the runtime's and Tutel's helloworld (before the tests of the
# step captured whole and of the runtime's steps without a torch sync: 4 s more, from the peers' wait,
# whose install is done long before its stage); 23 s for the unit CUDA cases; 2, 24 and 12 s for mpirun's steps; 36 + 60 s for
# the runtime's two configurations; 6-9 s per a2a.bench step, 29 s for the layer step with its profile
# (before its row of the step captured whole: 4 s more here, 2 s each from the layer tests' step and
# the runtime's) and 3 s per nccl_tests_ext program. Tutel's extension (one C++ file against torch's
# headers) compiles in about 66 s, so the peers' install starts after the build, beside the tests, and
# its stage waits for what is left (7 s: the fused gate's step took 8 of its 15, as another a2a.bench). The ES operators'
# step profiles each row since the fifth session of 2026-11-30 (3 s more, from the build's, which took
# 55 s at most). The budgets are caps adding up to the deadline.
STAGES = (
    Stage("tests", "tests/gpu in three processes, then the unit tests' CUDA cases", "1-tests.log", (
        Step("tests/gpu: kernels, collectives on NCCL, from_torch, staged 1 rank, graphs", 60,
             GPU_KERNEL_TESTS, collect(GPU_KERNEL_TESTS)),
        Step("tests/gpu: FP8 (kernels, the layer's dispatch, low latency)", 35, GPU_FP8_TESTS,
             collect(GPU_FP8_TESTS)),
        Step("tests/gpu: the graphed layer, the runtime, Tutel's helloworld", 40, GPU_LAYER_TESTS,
             collect(GPU_LAYER_TESTS)),
        Step("tests/unit CUDA cases", 26, UNIT_CUDA, collect(UNIT_CUDA)),
    )),
    Stage("mpirun", "mpirun on the one GPU: staged MPI with 2, 3 and 4 ranks, NCCL from a torch NCCL group",
          "2-mpirun.log", (
        Step("the kit's mpirun and mpi4py, 2 ranks", 3, KIT_MPIRUN, KIT_MPIRUN),
        Step("staged MPI transport, ranks sharing the GPU", 25, STAGED, collect(STAGED)),
        Step("NCCL communicator from a torch.distributed NCCL group, CUDA graphs", 14, NCCL_GROUP,
             collect(NCCL_GROUP)),
    )),
    Stage("runtime", "moe_runtime on CUDA tensors against its float64 reference, ranks sharing the GPU",
          "3-runtime.log", (
        Step("tests/run_mpi.py --gpu", 101, RUNTIME, lambda e: [*RUNTIME(e), "--collect-only"]),
    )),
    Stage("peers", "Tutel and Megatron-Core from the kit, for the layer step's comparison", "4-peers.log", (
        Step("install Tutel (its CUDA extension compiles) and Megatron-Core", 7, PEERS, lambda e: [*PEERS(e), "--dry"],
             early=True),
    )),
    Stage("bench", "the GPU benchmarks and their targets", "5-bench.log", (
        Step("a2a.bench --device cuda", 9, python_module("a2a.bench", *COLLECTIVES_ARGS),
             parse_only("a2a.bench", *COLLECTIVES_ARGS)),
        Step("a2a.bench --layout --device cuda", 8, python_module("a2a.bench", *LAYOUT_ARGS),
             parse_only("a2a.bench", *LAYOUT_ARGS)),
        Step("a2a.bench --op all --device cuda", 9, python_module("a2a.bench", *KERNEL_ARGS),
             parse_only("a2a.bench", *KERNEL_ARGS)),
        Step("a2a.bench --op esmm,ess,estmm --device cuda", 10, python_module("a2a.bench", *ES_ARGS),
             parse_only("a2a.bench", *ES_ARGS)),
        Step("a2a.bench --op quantize_fp8,dequantize_fp8 --device cuda", 7, python_module("a2a.bench", *FP8_ARGS),
             parse_only("a2a.bench", *FP8_ARGS)),
        Step("a2a.bench --op top_k_gate --device cuda", 8, python_module("a2a.bench", *GATE_ARGS),
             parse_only("a2a.bench", *GATE_ARGS)),
        Step("moe_runtime.bench --gpu-step", 36, python_module("moe_runtime.bench", *LAYER_ARGS),
             parse_only("moe_runtime.bench", *LAYER_ARGS)),
        *(Step(f"nccl_tests_ext {program} {' '.join(extra)}".rstrip(), 4, nccl_perf(program, *NCCL_ARGS, *extra),
               nccl_help(program, *NCCL_ARGS, *extra))
          for program, extra in (("alltoall_perf", ()), ("alltoallv_perf", ()), ("alltoall_flex_perf", ()),
                                 ("alltoall_perf", ("-G", "1")), ("alltoall_flex_perf", ("-G", "1")))),
    )),
)

PYTEST_SUMMARY = re.compile(r"^=*\s*\d+(/\d+)? (passed|failed|skipped|errors?|deselected|tests? collected)\b.*$")
RUNNER_SUMMARY = re.compile(r"^\d+ passed, \d+ failed\b.*$")  # tests/run_mpi.py's last line
# A skip that says there is no GPU (or no CUDA or NCCL build) means, on the GPU machine, a check that
# did not run: the step fails instead of passing with its cases skipped.
NO_GPU_SKIP = re.compile(r"no CUDA device|torch sees no GPU|built without (CUDA|NCCL)|no usable CUDA")
EXCERPT_LINE = re.compile(r"^(FAILED|ERROR|FAIL\b|E  |Traceback|\S+Error\b|RuntimeError|.*#wrong [1-9])")


def summarize(output: str) -> tuple[str, str, list[str]]:
    """(summary line, excerpt, skipped lines) of a step's output."""
    lines = [line for line in output.rstrip("\n").splitlines() if not line.startswith("===== ")]
    summary = next((line.strip("= ").strip() for line in reversed(lines)
                    if PYTEST_SUMMARY.match(line) or RUNNER_SUMMARY.match(line)), "")
    if not summary:
        summary = next((line.strip() for line in reversed(lines) if line.strip()), "")
    picked = [line for line in lines if EXCERPT_LINE.match(line)][:30]
    excerpt = "\n".join([*picked, "...", *lines[-12:]] if picked else lines[-20:])
    skips = [line for line in lines if line.startswith("SKIPPED")]
    return summary[:300], excerpt, skips


@dataclass
class Started:
    """A step whose command runs: its log, where its output begins, when it began."""
    stage: Stage
    step: Step
    log_path: Path
    offset: int
    started: float
    held: Held
    dry: bool


def start_step(stage: Stage, step: Step, environment: Environment, log_path: Path, *, dry: bool,
               budget_s: float) -> Started | Result:
    """Starts the step's command (a Result instead when nothing is to run)."""
    command = (step.dry if dry else step.command)
    if command is None:
        return Result(stage.key, step.name, NO_GPU if dry else "not run")
    if budget_s <= 0:
        return Result(stage.key, step.name, "not run: out of time (the 8-minute deadline)")
    argv = command(environment)
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        when = " (started after the build, in the background)" if step.early and not dry else ""
        log.write(f"\n===== {step.name}{' (dry run)' if dry else ''}: budget {budget_s:.0f} s{when}\n"
                  f"$ {' '.join(argv)}\n")
        log.flush()
        offset = log.tell()
        held = start_held(argv, cwd=environment.work, env=environment.env, log=log)
    return Started(stage, step, log_path, offset, time.monotonic(), held, dry)


def finish_step(started: Started, budget_s: float) -> Result:
    """Waits for the step at most budget_s more, then reads its result from its log."""
    stage, step, dry = started.stage, started.step, started.dry
    rc = started.held.wait(budget_s)
    over = rc is None
    seconds = time.monotonic() - started.started
    with open(started.log_path, "a", encoding="utf-8", errors="replace") as log:
        log.write(f"===== {step.name}: {'over budget' if over else f'exit {rc}'} after {seconds:.1f} s\n")
    with open(started.log_path, encoding="utf-8", errors="replace") as fh:
        fh.seek(started.offset)
        output = fh.read()
    summary, excerpt, skips = summarize(output)
    if over:
        status = f"over budget ({budget_s:.0f} s)"
    elif dry and step.dry is not step.command:
        status = DRY_PASSED if rc == 0 else f"{NO_GPU}; its dry part failed (exit {rc})"
    else:
        status = "passed" if rc == 0 else f"failed (exit {rc})"
        blind = [line for line in skips if NO_GPU_SKIP.search(line)]
        if blind and rc == 0:
            status = f"failed ({len(blind)} skip line(s) say there is no GPU or no CUDA/NCCL build)"
    return Result(stage.key, step.name, status, seconds, summary, excerpt if status not in ("passed", DRY_PASSED) else "",
                  skips, output, budget_s)


def run_step(stage: Stage, step: Step, environment: Environment, log_path: Path, *, dry: bool,
             budget_s: float) -> Result:
    started = start_step(stage, step, environment, log_path, dry=dry, budget_s=budget_s)
    return started if isinstance(started, Result) else finish_step(started, budget_s)
