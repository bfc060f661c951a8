#!/usr/bin/env python3
"""Runs tests/mpi under mpirun for a matrix of world sizes and topologies.

    python tests/run_mpi.py                 # the whole matrix (make test-mpi)
    python tests/run_mpi.py --list          # show the configurations (--gpu: the GPU ones)
    python tests/run_mpi.py --only 2x4 --only np3 -v
    python tests/run_mpi.py --np 6 --local-size 3 -k flex
    python tests/run_mpi.py --gpu           # the configurations that need a GPU (not in the matrix)
    python tests/run_mpi.py --gpu --collect-only   # import and collect them only (no GPU needed)
    python tests/run_mpi.py --gpu --test-device cpu   # run them on the host (A2A_TEST_DEVICE=cpu)

Topologies are emulated with A2A_LOCAL_SIZE (nodes = blocks of local_size
consecutive ranks); without it every rank is on this one machine. Only rank 0
prints; the other ranks write build/test-logs/<config>/rank<r>.log, and when a
configuration fails the logs of its failing ranks are printed. Every run sets
A2A_TIMEOUT_S, so that a deadlock fails instead of hanging, and every mpirun has
a wall-clock limit. Prints one line per configuration and finally
`N passed, M failed` (configurations); exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRAPPER = os.path.join("tests", "mpi", "_rank_pytest.py")
CLUSTER_TOOL = os.path.join(ROOT, "tools", "cluster.py")
# --cluster: these configurations with their nodes as network namespaces (tools/cluster.py): TCP
# between nodes, shared memory within, the topology detected rather than emulated.
CLUSTER_CONFIGS = ("2x2", "4x2", "3x1", "moe-2x2")
MPI_TESTS = os.path.join("tests", "mpi")
TIMEOUT_TESTS = os.path.join("tests", "mpi", "test_mpi_timeout.py")
# The layer's kept agreement's window (a rank that skips its call): a timeout, in the same mpiruns.
KEPT_TIMEOUT_TESTS = os.path.join("tests", "mpi_runtime", "test_runtime_kept_timeout.py")
THREAD_TESTS = os.path.join("tests", "mpi", "test_mpi_threads.py")
FLEX_TESTS = os.path.join("tests", "mpi", "test_mpi_flex.py")
RUNTIME_TESTS = os.path.join("tests", "mpi_runtime")  # moe_runtime: its own configurations
FLEXMOE_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_flex.py")  # FlexMoE also on 2 ranks (the np 2)
HEXA_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_hexa.py")  # Hexa-MoE's layers also on 2 ranks (np 2, 4, 8)
# The dictionary's flows (expert, dropless, data- and model-centric) on one layout, also on 2 ranks.
FLOW_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_dictionary_flows.py")
# One model on every rank and the ranks' agreement on the configuration, also on 3 ranks (an odd world).
ONE_MODEL_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_one_model.py")
LAYER_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_layer.py")  # the layer against its reference: also torchrun's
# The graphed layer's bookkeeping across ranks (stand-in captures): also over torchrun's gloo group, whose
# host twin checks each replay's call as the gloo group beside NCCL does for from_torch on GPUs.
GRAPH_TESTS = os.path.join(RUNTIME_TESTS, "test_runtime_graphs.py")
TUTEL_TESTS = os.path.join("tests", "mpi_tutel")  # moe_runtime.moe, Tutel's surface: checkpoints and groups

# Variables of the library that a developer's shell must not leak into a run.
A2A_VARIABLES = (
    "A2A_LOCAL_SIZE",
    "A2A_TIMEOUT_S",
    "A2A_MPI_DATATYPES",
    "A2A_MPI_MAX_COUNT",
    "A2A_TEST_TIMEOUT",
    "A2A_TEST_STAGING",
    "A2A_TEST_THREADS",
    "A2A_TEST_JAX",
    "A2A_TEST_MPI_THREAD_LEVEL",
    "A2A_TEST_DEVICE",
    "A2A_DEBUG",
    "A2A_FLEX_PATH",
    "A2A_NUM_THREADS",
    "A2A_TEST_LAUNCHER",
    "A2A_TEST_LARGE",
)
# JAX arrays against jax.lax.all_to_all: their own configurations (A2A_TEST_JAX=1), so that the other
# configurations do not import JAX in every rank.
JAX_TESTS = os.path.join(MPI_TESTS, "test_mpi_jax.py")
# Every test file but the timeout, thread and JAX ones (which run in their own configurations).
COLLECTIVE_TESTS = [
    os.path.join(MPI_TESTS, name)
    for name in sorted(os.listdir(os.path.join(ROOT, MPI_TESTS)))
    if name.startswith("test_")
    and name.endswith(".py")
    and name not in (os.path.basename(TIMEOUT_TESTS), os.path.basename(THREAD_TESTS), os.path.basename(JAX_TESTS))
]


@dataclass
class Config:
    name: str
    np: int
    local_size: int | None = None  # None: detected (every rank on this machine)
    paths: list[str] = field(default_factory=lambda: [MPI_TESTS])
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    timeout: int | None = None  # wall-clock limit of the mpirun; None: --timeout
    gpu: bool = False  # needs a GPU: not in the default matrix (--gpu, --only NAME)
    cluster: bool = False  # its nodes as network namespaces (--cluster)
    launcher: str = "mpirun"  # or "torchrun": a gloo group and no MPI beneath (tests/launcher.py)

    def describe(self) -> str:
        if self.cluster:
            nodes, local = self.cluster_shape()
            return f"np={self.np}, {nodes} namespace node(s) x {local}, TCP between them" + \
                (f", {self.note}" if self.note else "")
        topo = f"A2A_LOCAL_SIZE={self.local_size}" if self.local_size else "detected topology"
        launched = ", torchrun" if self.launcher == "torchrun" else ""
        return f"np={self.np}{launched}, {topo}" + (f", {self.note}" if self.note else "")

    def cluster_shape(self) -> tuple[int, int]:
        """(nodes, ranks per node) on the namespace cluster."""
        local = self.local_size or self.np
        return self.np // local, local


# tests/mpi/test_mpi_large.py's 64 MiB runs (5-10 s a configuration) stay in np2, np3, 2x2, 4x2, the staged
# data path and torchrun-np2: one or two nodes, an odd world, 8 ranks on 2dh, each transport.
SMALL = {"A2A_TEST_LARGE": "0"}

CONFIGS = [
    Config("np1", 1, env=SMALL),
    Config("np2", 2),
    Config("np3", 3),
    Config("np4", 4, env=SMALL),
    Config("np8", 8, env=SMALL),
    Config("2x2", 4, 2, note="2 nodes x 2 ranks"),
    Config("4x2", 8, 2, note="4 nodes x 2 ranks"),
    Config("2x4", 8, 4, env=SMALL, note="2 nodes x 4 ranks"),
    Config("3x1", 3, 1, env=SMALL, note="3 nodes x 1 rank"),
    Config("np3-local2", 3, 2, env=SMALL, note="irregular: 2dh must be rejected"),
    # The code of the CUDA communicators with host copies for device ones
    # (A2A_TEST_STAGING, tests/mpi/conftest.py): data staged through host buffers
    # as with transport="mpi", device="cuda"; control messages through a
    # device buffer as on a communicator made from a NCCL unique id.
    Config(
        "staged-2x2",
        4,
        2,
        paths=COLLECTIVE_TESTS,
        env={"A2A_TEST_STAGING": "staged"},
        note="staged data path",
    ),
    # The same, with the check of every call that the ranks predicted posted
    # instead of run as a round, as on a communicator of MPI and NCCL
    # (docs/algorithms.md, "The predicted check").
    Config(
        "predicted-np3",
        3,
        paths=COLLECTIVE_TESTS,
        env={"A2A_TEST_STAGING": "predicted", **SMALL},
        note="staged, predicted check",
    ),
    Config(
        "control-2x2",
        4,
        2,
        paths=COLLECTIVE_TESTS,
        env={"A2A_TEST_STAGING": "control", **SMALL},
        note="control via device",
    ),
    # Every flexible all-to-all through one forced path (A2A_FLEX_PATH): the
    # small layouts of the suite take pieces and datatypes too, and their
    # small messages the in-band check's scratch copy (strided for datatypes).
    Config("jax-np3", 3, paths=[JAX_TESTS], env={"A2A_TEST_JAX": "1"}, note="JAX arrays against jax.lax.all_to_all"),
    Config("jax-2x2", 4, 2, paths=[JAX_TESTS], env={"A2A_TEST_JAX": "1"},
           note="JAX arrays against jax.lax.all_to_all, 2 nodes x 2 ranks"),
    Config("flex-pieces-3", 3, paths=[FLEX_TESTS], env={"A2A_FLEX_PATH": "pieces"}, note="flex: pieces forced"),
    Config(
        "flex-datatypes-2x2", 4, 2, paths=[FLEX_TESTS], env={"A2A_FLEX_PATH": "datatypes"}, note="flex: datatypes forced"
    ),
    # torchrun on CPUs (tests/launcher.py): the ranks share a gloo group and no MPI is beneath them;
    # every communicator is a2a.Comm.from_torch(device="cpu"), whose messages are the group's. The tests
    # that use MPI themselves skip.
    Config("torchrun-np2", 2, paths=COLLECTIVE_TESTS, launcher="torchrun", note="the collectives over gloo"),
    Config("torchrun-2x2", 4, 2, paths=[*COLLECTIVE_TESTS, LAYER_TESTS, ONE_MODEL_TESTS, GRAPH_TESTS, TUTEL_TESTS],
           launcher="torchrun", env=SMALL,
           note="the collectives, the layer and Tutel's surface over gloo, 2 nodes x 2 ranks",
           timeout=900),
    # moe_runtime's layer against its reference: the (W, E) pairs,
    # on one node (linear only) and on two (linear and 2dh).
    Config("moe-np4", 4, paths=[RUNTIME_TESTS], note="moe_runtime", timeout=900),
    Config("moe-2x2", 4, 2, paths=[RUNTIME_TESTS], note="moe_runtime, 2 nodes x 2 ranks", timeout=900),
    Config("moe-2x4", 8, 4, paths=[RUNTIME_TESTS], note="moe_runtime, 2 nodes x 4 ranks", timeout=900),
    Config("flexmoe-np2", 2, paths=[FLEXMOE_TESTS], env={"A2A_TEST_FLEX_TIMEOUT": "1"},
           note="FlexMoE on 2 ranks, and an adjustment's timeout", timeout=300),
    Config("hexa-np2", 2, paths=[HEXA_TESTS, FLOW_TESTS],
           note="Hexa-MoE's data- and model-centric layers, and the dictionary's flows, on 2 ranks", timeout=300),
    Config("one-model-np3", 3, paths=[ONE_MODEL_TESTS],
           note="one model on every rank, the configuration agreed, on 3 ranks", timeout=300),
    Config("tutel-2x2", 4, 2, paths=[TUTEL_TESTS],
           note="Tutel's moe_layer: checkpoints both ways, groups under mpirun, 2 nodes x 2 ranks", timeout=300),
    # moe_runtime on CUDA tensors (A2A_TEST_DEVICE=cuda, tests/mpi_runtime/runtime_util.py): the whole
    # runtime suite, every rank on GPU 0 through the staged MPI transport (NCCL refuses several ranks
    # on one GPU), on one node and on two emulated ones (2dh). They need a GPU, so they are not in the
    # default matrix: --gpu runs them, --only names one.
    Config("gpu-moe-np2", 2, paths=[RUNTIME_TESTS], env={"A2A_TEST_DEVICE": "cuda"},
           note="moe_runtime on CUDA, 2 ranks on one GPU", timeout=300, gpu=True),
    Config("gpu-moe-2x2", 4, 2, paths=[RUNTIME_TESTS], env={"A2A_TEST_DEVICE": "cuda"},
           note="moe_runtime on CUDA, 2 nodes x 2 ranks on one GPU", timeout=300, gpu=True),
    Config(
        "timeout-np2", 2, paths=[TIMEOUT_TESTS, KEPT_TIMEOUT_TESTS], env={"A2A_TEST_TIMEOUT": "1"},
        note="timeouts", timeout=300,
    ),
    Config(
        "timeout-np3", 3, paths=[TIMEOUT_TESTS, KEPT_TIMEOUT_TESTS], env={"A2A_TEST_TIMEOUT": "1"},
        note="timeouts", timeout=300,
    ),
    # Calls from two threads at once, with MPI_THREAD_MULTIPLE (mpi4py's
    # default) and with MPI_THREAD_SERIALIZED (tests/mpi/_rank_pytest.py
    # passes the level to mpi4py before MPI starts).
    Config(
        "threads-np2", 2, paths=[THREAD_TESTS], env={"A2A_TEST_THREADS": "1"}, note="threads", timeout=300
    ),
    Config(
        "threads-serialized",
        2,
        paths=[THREAD_TESTS],
        env={"A2A_TEST_THREADS": "1", "A2A_TEST_MPI_THREAD_LEVEL": "serialized"},
        note="threads, MPI_THREAD_SERIALIZED",
        timeout=300,
    ),
]

SUMMARY_RE = re.compile(
    r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|tests? collected)\b.* in \d+(\.\d+)?s\b"
)


@functools.cache
def launch():
    """a2a/launch.py (the mpirun and torchrun command lines), loaded from its
    file so that the runner itself never loads a2a's extension or MPI."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_a2a_launch", os.path.join(ROOT, "a2a", "launch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mpirun_command(np: int, command: list[str]) -> list[str]:
    """a2a.launch.mpirun_command (adds --allow-run-as-root / --oversubscribe)."""
    return launch().mpirun_command(np, command)


def run_env(config: Config, rank_timeout_s: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in A2A_VARIABLES}
    if config.launcher == "torchrun":  # no MPI beneath: nothing of an enclosing mpirun either
        env = {k: v for k, v in env.items() if not k.startswith(launch().MPIRUN_PREFIXES)}
        env["A2A_TEST_LAUNCHER"] = "torchrun"
    env["A2A_TIMEOUT_S"] = str(rank_timeout_s)
    if config.local_size:
        env["A2A_LOCAL_SIZE"] = str(config.local_size)
    env.update(config.env)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def pytest_summary(output: str) -> str:
    for line in reversed(output.splitlines()):
        if SUMMARY_RE.search(line):
            return line.strip().strip("=").strip()
    return "no pytest summary"


SECTION_RE = re.compile(r"^=+ (FAILURES|ERRORS) =+$")


def excerpt(text: str, lines: int) -> str:
    """The part of a pytest log worth reading: from the first failure report
    on (at most `lines` lines) plus the final summary; else the last lines."""
    parts = text.rstrip("\n").splitlines()
    start = next((i for i, line in enumerate(parts) if SECTION_RE.match(line)), None)
    if start is None:
        if len(parts) <= lines:
            return "\n".join(parts)
        return f"[... {len(parts) - lines} earlier lines in the log ...]\n" + "\n".join(parts[-lines:])
    body = parts[start:]
    if len(body) <= lines + 3:
        return "\n".join(body)
    return "\n".join([*body[:lines], f"[... {len(body) - lines - 3} more lines in the log ...]", *body[-3:]])


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def rank_codes(log_dir: str, np: int) -> dict[int, int | None]:
    codes: dict[int, int | None] = {}
    for rank in range(np):
        text = read(os.path.join(log_dir, f"rank{rank}.rc")).strip()
        codes[rank] = int(text) if text.lstrip("-").isdigit() else None
    return codes


def run_config(config: Config, args: argparse.Namespace) -> bool:
    log_dir = os.path.join(args.log_dir, config.name)
    shutil.rmtree(log_dir, ignore_errors=True)
    os.makedirs(log_dir, exist_ok=True)
    pytest_args = ["-q", "-rfE", "-p", "no:cacheprovider", "--color=no", *config.paths]
    if args.k:
        pytest_args += ["-k", args.k]
    if args.collect_only:
        pytest_args.append("--collect-only")
    if args.durations:
        pytest_args.append(f"--durations={args.durations}")
    rank_command = [sys.executable, WRAPPER, "--log-dir", log_dir, "--", *pytest_args]
    if config.cluster:
        nodes, local = config.cluster_shape()
        command = [sys.executable, CLUSTER_TOOL, "run", "--nodes", str(nodes), "--ranks-per-node", str(local),
                   "--", *rank_command]
    elif config.launcher == "torchrun":
        command = launch().torchrun_command(config.np, rank_command)
    else:
        command = mpirun_command(config.np, rank_command)
    env = run_env(config, args.rank_timeout)
    if config.cluster:
        env.pop("A2A_LOCAL_SIZE", None)  # the nodes are real: the topology is detected
        env["A2A_TEST_NAMESPACES"] = "1"  # the ranks' loopbacks are their nodes' own (launcher.ON_NAMESPACE_CLUSTER)

    limit = min(config.timeout or args.timeout, args.timeout)
    start = time.monotonic()
    output_lines: list[str] = []
    timed_out = False
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: a timeout kills all of it
    )
    try:
        deadline = start + limit
        assert process.stdout is not None
        # Reading line by line: -v streams rank 0's output as it comes.
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not selector.select(timeout=min(remaining, 1.0)):
                if process.poll() is not None:
                    break
                continue
            line = process.stdout.readline()
            if not line:
                break
            output_lines.append(line)
            if args.verbose:
                sys.stdout.write(line)
                sys.stdout.flush()
        selector.close()
        if timed_out:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            rest = ""
        else:
            rest = process.stdout.read()
            process.wait()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if config.cluster:  # a killed run leaves its namespaces (and the daemons in them) behind
            subprocess.run([sys.executable, CLUSTER_TOOL, "down"], capture_output=True, check=False)
    output = "".join(output_lines) + rest
    seconds = time.monotonic() - start
    with open(os.path.join(log_dir, "rank0.log"), "w") as f:
        f.write(output)

    codes = rank_codes(log_dir, config.np)
    failing = [rank for rank, code in codes.items() if code != 0]
    ok = process.returncode == 0 and not failing and not timed_out
    if timed_out:
        status = f"TIMEOUT after {limit} s (killed; see the rank logs)"
    elif ok:
        status = "ok"
    else:
        status = f"FAILED (mpirun exit {process.returncode}; failing ranks: {failing or 'none reported'})"
    print(
        f"{'PASS' if ok else 'FAIL'}  {config.name:<12} {config.describe():<58} "
        f"{pytest_summary(output)}  [{seconds:.1f} s]  {status if not ok else ''}".rstrip(),
        flush=True,
    )

    if not ok:
        bar = "-" * 78
        print(f"{bar}\n{config.name}: rank 0 and mpirun output ({log_dir}/rank0.log)\n{bar}")
        print(excerpt(output, args.tail_lines), flush=True)
        for rank in failing:
            if rank == 0:
                continue
            path = os.path.join(log_dir, f"rank{rank}.log")
            code = codes[rank]
            why = "no exit code recorded (killed or hung?)" if code is None else f"pytest exit code {code}"
            print(f"{bar}\n{config.name}: rank {rank}, {why} ({path})\n{bar}")
            print(excerpt(read(path), args.tail_lines), flush=True)
        print(bar, flush=True)
    return ok


def select(args: argparse.Namespace) -> list[Config]:
    if args.np:
        return [
            Config(
                f"np{args.np}" + (f"-local{args.local_size}" if args.local_size else ""),
                args.np,
                args.local_size,
            )
        ]
    gpu = [c for c in CONFIGS if c.gpu] if args.gpu else []
    if not args.only:
        chosen = gpu or [c for c in CONFIGS if not c.gpu]
    else:
        wanted = [name for item in args.only for name in item.split(",") if name]
        by_name = {c.name: c for c in CONFIGS}
        unknown = [name for name in wanted if name not in by_name]
        if unknown:
            sys.exit(f"run_mpi.py: unknown configuration(s) {unknown}; see --list (and --list --gpu)")
        named = [by_name[name] for name in wanted]
        chosen = named + [c for c in gpu if c not in named]
    if args.cluster:
        if not args.only:
            chosen = [c for c in CONFIGS if c.name in CLUSTER_CONFIGS]
        chosen = [replace(c, name=c.name + "-cluster", cluster=True) for c in chosen]
    if args.test_device:
        return [on_test_device(c, args.test_device) for c in chosen]
    return chosen


def on_test_device(config: Config, device: str) -> Config:
    """`config` with the runtime suite's device forced (A2A_TEST_DEVICE): a
    GPU configuration with "cpu" runs the same tests and code on the host
    (only the CUDA lines untried), without a GPU. Its logs go elsewhere."""
    return replace(config, name=f"{config.name}@{device}", env={**config.env, "A2A_TEST_DEVICE": device},
                               note=f"{config.note}, A2A_TEST_DEVICE={device}".lstrip(", "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--only", action="append", default=[], help="run only these configurations (repeatable)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="the configurations that need a GPU (gpu-*; not in the default matrix)"
    )
    parser.add_argument(
        "--collect-only", action="store_true", help="only import and collect the tests (pytest --collect-only)"
    )
    parser.add_argument(
        "--test-device",
        choices=("cpu", "cuda"),
        help="force the runtime suite's device (A2A_TEST_DEVICE) in the selected configurations: "
        "--gpu --test-device cpu runs the GPU configurations on the host",
    )
    parser.add_argument(
        "--cluster", action="store_true",
        help=f"run on a cluster of network namespaces (tools/cluster.py, root): {', '.join(CLUSTER_CONFIGS)} "
        "by default, or the --only ones that have nodes",
    )
    parser.add_argument("--np", type=int, help="run one custom configuration with this many ranks")
    parser.add_argument("--local-size", type=int, help="with --np: emulated ranks per node")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--durations", type=int, default=0, help="rank 0 reports its N slowest tests (pytest)")
    parser.add_argument("-v", "--verbose", action="store_true", help="stream rank 0's pytest output")
    parser.add_argument("--timeout", type=int, default=900, help="wall-clock limit per mpirun, seconds")
    parser.add_argument("--rank-timeout", type=int, default=60, help="A2A_TIMEOUT_S for the ranks")
    parser.add_argument("--tail-lines", type=int, default=150, help="log lines shown per failing rank")
    parser.add_argument("--log-dir", default=os.path.join(ROOT, "build", "test-logs"))
    args = parser.parse_args(argv)
    if args.local_size and not args.np:
        parser.error("--local-size needs --np")

    configs = select(args)
    if args.list:
        for config in configs:
            print(f"{config.name:<12} {config.describe():<58} {' '.join(config.paths)}")
        return 0

    start = time.monotonic()
    results = [run_config(config, args) for config in configs]
    passed = sum(results)
    failed = len(results) - passed
    print(f"total wall time {time.monotonic() - start:.1f} s; logs in {args.log_dir}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
