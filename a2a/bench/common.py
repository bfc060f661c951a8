"""What the benchmark families share: sizes (a2a._sweep's, which a2a.sim
reads too), the clock, taking turns, formatting and the JSON record of a
run."""

from __future__ import annotations

import datetime
import json
import math
import os
import select
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from .._sweep import parse_size, size_text, v_counts

__all__ = [
    "COMMAND_ENV",
    "LINK_ENV",
    "PROGRESS_AFTER_S",
    "Clock",
    "Progress",
    "command_line",
    "cuda_comm",
    "cuda_missing",
    "format_time",
    "forward_output",
    "geomean",
    "out_of_bounds_line",
    "parse_size",
    "relaunch",
    "resolve_device",
    "size_text",
    "strip_np",
    "take_turns",
    "utc_timestamp",
    "v_counts",
    "write_json",
]

COMMAND_ENV = "A2A_BENCH_COMMAND"  # the command line the user typed (set when relaunched under mpirun)
LINK_ENV = "A2A_BENCH_LINK"  # the namespace cluster's link rate, or "unshaped" (set by relaunch_on_cluster)

# ---------------------------------------------------------------------------
# Timing


class Clock:
    """Seconds per call of n back-to-back calls: perf_counter on CPU, CUDA
    events on the current stream (torch) on CUDA."""

    def __init__(self, torch: Any, device: str):
        self.torch = torch
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.current_stream().synchronize()

    def now(self) -> float:
        """perf_counter once the work queued so far is done (on CUDA, after
        sync): a host clock for spans that other ranks, or the host, take part in."""
        self.sync()
        return time.perf_counter()

    def time(self, fn: Callable[[], Any], n: int) -> float:
        if self.cuda:
            stream = self.torch.cuda.current_stream()
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(n):
                fn()
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        start_s = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start_s) / n


def cuda_missing() -> str | None:
    """Why ``--device cuda`` cannot run here, or None: torch sees no GPU, or
    this a2a was built without CUDA (a benchmark reports it and exits 2)."""
    import torch

    import a2a

    if not torch.cuda.is_available():
        return "--device cuda: torch sees no GPU"
    if not a2a.config().get("cuda"):
        return "--device cuda: this a2a was built without CUDA"
    return None


def resolve_device(args: Any) -> str | None:
    """Fills ``args.device`` when it was not given (cuda where it can run,
    else cpu); returns why ``--device cuda`` cannot run here, or None."""
    missing = cuda_missing()
    if args.device is None:
        args.device = "cpu" if missing else "cuda"
    return missing if args.device == "cuda" else None


def names_only(argv: list[str], ops: tuple[str, ...]) -> bool:
    """Whether argv's --op names some ops, all of them among `ops` (how
    ``python -m a2a.bench`` picks the one-process --op family)."""
    for i, token in enumerate(argv):
        value = token.split("=", 1)[1] if token.startswith("--op=") else argv[i + 1] if token == "--op" and i + 1 < len(argv) else None
        if value is not None:
            names = {name.strip().lower() for name in value.split(",") if name.strip()}
            return bool(names) and names <= set(ops)
    return False


def int_list(text: str) -> list[int]:
    """``4096,16384`` -> [4096, 16384] (an argparse type)."""
    return [int(v) for v in text.split(",") if v.strip()]


def start_op_bench(args: Any) -> tuple[Any, Any, list[str]] | None:
    """What an ``--op`` benchmark of one process does first: its --threads
    for a2a and torch, its device (args.device filled), torch and a2a
    imported; (torch, a2a, the ops named by --op), or None after printing why
    the device cannot run."""
    if args.threads:
        os.environ["A2A_NUM_THREADS"] = str(args.threads)
    import torch

    import a2a

    if args.threads:
        torch.set_num_threads(args.threads)
    missing = resolve_device(args)
    if missing is not None:
        print(f"a2a.bench --op {args.op}: {missing}", file=sys.stderr)
        return None
    return torch, a2a, [name.strip().lower() for name in args.op.split(",") if name.strip()]


def cuda_comm(world: Any, *, local_size: int | None = None, transport: str | None = None) -> Any:
    """``a2a.Comm.from_mpi(world, device="cuda")`` on this rank's GPU: its rank
    on its node modulo the GPUs torch sees, made torch's current device.
    NCCL (the default transport) takes one GPU per rank: a node with more
    ranks than GPUs raises SystemExit on every rank of it; the staged MPI
    transport (``transport="mpi"``) lets ranks share one."""
    import torch
    from mpi4py import MPI

    import a2a

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, on_node = node.Get_rank(), node.Get_size()
    node.Free()
    gpus = torch.cuda.device_count()
    if transport in (None, "nccl") and on_node > gpus:
        raise SystemExit(f"--device cuda: {on_node} ranks on this node and {gpus} GPU(s), but NCCL takes one GPU "
                         "per rank: run fewer ranks, or --transport mpi (staged through host memory; ranks may "
                         "share a GPU)")
    torch.cuda.set_device(local_rank % gpus)
    return a2a.Comm.from_mpi(world, local_size=local_size, device="cuda", transport=transport)


def per_call_counters(run: Callable[[], Any], synchronize: Callable[[], Any], calls: int = 3) -> dict[str, float]:
    """--counters: what one call of `run` costs on this rank (a2a.counters over the
    process: a call may use communicators of its own), the mean of `calls` after one."""
    import a2a

    run()
    with a2a.counting() as cost:
        for _ in range(calls):
            run()
    synchronize()
    return cost.counters.per(calls)


def gpu_name() -> str:
    """The name of the current CUDA device (torch's)."""
    import torch

    return torch.cuda.get_device_name()


def take_turns(timings: list[Callable[[], float]], repeats: int) -> list[list[float]]:
    """`repeats` samples of each timing, taken in rounds in which they take
    turns: a busy moment on a shared machine hits all of them alike, so
    their ratios stay fair."""
    samples: list[list[float]] = [[] for _ in timings]
    for _ in range(repeats):
        for timing, taken in zip(timings, samples):
            taken.append(timing())
    return samples


def medians_in_turns(paths: list[Callable[[], Any]], clock: Clock, iters: int, repeats: int) -> list[float]:
    """Seconds per call of each path: one untimed call each, then the median
    of `repeats` samples (each `iters` calls on `clock`) taken in turns."""
    for fn in paths:
        fn()
    clock.sync()
    samples = take_turns([lambda fn=fn: clock.time(fn, iters) for fn in paths], repeats)
    return [statistics.median(s) for s in samples]


# ---------------------------------------------------------------------------
# Output


def add_timing_flags(parser: Any, *, iters: int, repeats: int, warmup: int) -> None:
    """-n/--iters, -r/--repeats and -w/--warmup_iters, with these defaults."""
    parser.add_argument("-n", "--iters", type=int, default=iters, help=f"calls per repetition (default {iters})")
    parser.add_argument("-r", "--repeats", type=int, default=repeats,
                        help=f"repetitions; rows show the median (default {repeats})")
    parser.add_argument("-w", "--warmup_iters", type=int, default=warmup, help=f"warm-up calls (default {warmup})")


class Memcpy:
    """The same-run memcpy baseline of a one-process --op benchmark: for each
    name, torch ``copy_`` of a buffer of ``bytes / 2`` into another on the
    device, so that it reads and writes that op's ``bytes``."""

    def __init__(self, torch: Any, nbytes: dict[str, int], device: str):
        self.source = {name: torch.empty(n // 2, dtype=torch.uint8, device=device) for name, n in nbytes.items()}
        self.target = {name: torch.empty_like(buffer) for name, buffer in self.source.items()}

    def __call__(self, name: str) -> Any:
        return self.target[name].copy_(self.source[name])


def add_op_bench_flags(parser: Any, *, repeats: int, iters: int) -> None:
    """The flags every one-process ``--op`` benchmark takes: -r/--repeats and
    -n/--iters with these defaults, --threads, --device and --json."""
    parser.add_argument("-r", "--repeats", type=int, default=repeats, help=f"repetitions, median shown (default {repeats})")
    parser.add_argument("-n", "--iters", type=int, default=iters, help=f"calls per timing (default {iters})")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for a2a and torch (default: every core)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default cuda when torch sees a GPU")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")


def require_at_least(parser: Any, checks: Iterable[tuple[str, float, float]]) -> None:
    """parser.error for the first (flag, value, low) whose value is below low."""
    for flag, value, low in checks:
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")


def format_time(us: float, width: int = 7) -> str:
    """Microseconds with fewer decimals as they grow, right-aligned in `width` (0: unpadded)."""
    decimals = 0 if us >= 10000.0 else 1 if us >= 100.0 else 2
    return f"{us:{width}.{decimals}f}"


def geomean(values: list[float]) -> float | None:
    """The geometric mean of the positive values, None if there are none."""
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def out_of_bounds_line(wrong: int) -> str:
    """nccl-tests' verdict line: the wrong elements of the whole run."""
    return f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}"


# ---------------------------------------------------------------------------
# Progress

PROGRESS_AFTER_S = 2.0  # a sweep done sooner shows no progress line at all


class Progress:
    """How far a long sweep got, as one line on stderr rewritten in place
    ("\\r"): ``[a2a.bench] 12/40 rows, float 64M, 8 s``.

    The sweep is `groups` (labels, measured in this order) of
    `rows_per_group` table rows each. Only where `enabled` (the lead rank),
    only when the stream is a terminal (a pipe, a file or a log gets
    nothing), and only once `after_s` seconds passed, so short runs stay
    silent. Whoever prints to stdout clears the line first (both may be the
    same terminal), and at the end; stdout and the JSON never see it."""

    def __init__(self, groups: list[str], rows_per_group: int, *, label: str, enabled: bool = True,
                 stream: Any = None, after_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.groups = groups
        self.rows_per_group = max(1, rows_per_group)
        self.total = len(groups) * rows_per_group
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.clock = clock
        self.start = clock()
        self.active = enabled and _is_terminal(self.stream)
        self.width = 0  # characters of the line on screen; 0 when none is

    def show(self, rows: int) -> None:
        """Rewrites the line: `rows` rows are done, the next group is being measured."""
        if not self.active or not self.groups or rows >= self.total:  # done: the footer follows
            return
        elapsed = self.clock() - self.start
        if elapsed < self.after_s:
            return
        what = self.groups[min(rows // self.rows_per_group, len(self.groups) - 1)]
        text = f"[{self.label}] {rows}/{self.total} rows, {what}, {elapsed:.0f} s".ljust(self.width)
        self.stream.write("\r" + text)
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        """Erases the line, if one is on screen."""
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def forward_output(command: list[str], env: dict[str, str], progress: Progress, *, out: BinaryIO | None = None,
                   tick_s: float = 1.0) -> int:
    """Runs `command` with its stdout passed through this process, and
    returns its exit code.

    The progress line of a relaunch under mpirun is drawn here, by the
    process the user started: the ranks get a pipe, not the terminal, for
    stderr, and Open MPI holds back a line until its newline, so no rank
    can rewrite a line in place. Each whole line of `command`'s stdout goes
    on to `out` (default: this stdout) unchanged, after the progress line
    is cleared; a table row (a line that is neither empty nor a ``#``
    comment) counts one row; the line is redrawn after each batch of lines
    and every `tick_s` seconds, so its clock keeps going through a long
    size. stdin and stderr are the command's own."""
    out = sys.stdout.buffer if out is None else out
    rows, pending = 0, b""
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            while True:
                ready, _, _ = select.select([fd], [], [], tick_s)
                data = os.read(fd, 1 << 16) if ready else None
                if data == b"":  # the command closed its stdout
                    break
                if data:
                    *lines, pending = (pending + data).split(b"\n")
                    if lines:
                        progress.clear()
                        out.write(b"".join(line + b"\n" for line in lines))
                        out.flush()
                        rows += sum(1 for line in lines if line.strip() and not line.startswith(b"#"))
                progress.show(rows)
        except BaseException:  # Ctrl-C (mpirun got it too), or this stdout went away
            proc.stdout.close()
            try:
                proc.wait(timeout=5)  # mpirun stops its ranks
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            progress.clear()
        if pending:  # a last line without its newline
            out.write(pending)
            out.flush()
    return proc.returncode


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


# ---------------------------------------------------------------------------
# The JSON record


def command_line(argv: list[str], module: str = "a2a.bench") -> str:
    """The command as the user typed it: passed down by a relaunch under
    mpirun, else rebuilt from argv."""
    return os.environ.get(COMMAND_ENV) or shlex.join(["python", "-m", module, *argv])


# ---------------------------------------------------------------------------
# Relaunching under mpirun


def strip_np(argv: list[str]) -> list[str]:
    """argv without --np N / --np=N (the child runs under mpirun instead)."""
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == "--":
            out += argv[i:]
            break
        if token == "--np":
            skip = True
            continue
        if token.startswith("--np="):
            continue
        out.append(token)
    return out


def on_every_rank(bench: Callable[[], int]) -> int:
    """bench() on this rank of MPI_COMM_WORLD. When it raises and there
    are other ranks, the traceback is printed and the world aborted: one
    rank failing alone would leave the others waiting in a collective."""
    import traceback

    from mpi4py import MPI

    try:
        return bench()
    except Exception:
        if MPI.COMM_WORLD.Get_size() == 1:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise


def relaunch(module: str, argv: list[str], np: int | None, local_size: int | None, *, default_np: int,
             default_local_size: int, progress: Progress | None = None) -> int:
    """Runs `python -m module argv` (without --np) on np ranks (default_np
    when None) under mpirun. With neither --np, --local-size nor
    A2A_LOCAL_SIZE, default_np ranks are emulated as nodes of
    default_local_size. An active `progress` (this stderr is a terminal)
    is drawn from the rows the run prints (:func:`forward_output`)."""
    from a2a import launch

    ranks = np if np is not None else default_np
    env = {COMMAND_ENV: command_line(argv, module)}
    if local_size is None and np is None and "A2A_LOCAL_SIZE" not in os.environ and ranks % default_local_size == 0:
        local_size = default_local_size
    if local_size is not None:
        env["A2A_LOCAL_SIZE"] = str(local_size)
    command = [sys.executable, "-m", module, *strip_np(argv)]
    try:
        if progress is not None and progress.active:
            return forward_output(launch.mpirun_command(ranks, command), {**os.environ, **env}, progress)
        return launch.run(ranks, command, env=env)
    except FileNotFoundError as error:
        print(f"{module}: {error}", file=sys.stderr)
        return 2


def relaunch_on_cluster(module: str, argv: list[str], nodes: int, ranks_per_node: int, rate: str | None) -> int:
    """Runs `python -m module argv` on `nodes` x `ranks_per_node` ranks of the
    namespace cluster (:mod:`a2a.cluster`; the one that is up, or one brought
    up at `rate` for this run alone). The ranks see the real topology, so
    A2A_LOCAL_SIZE is not passed on."""
    from a2a import cluster

    env = {COMMAND_ENV: command_line(argv, module), LINK_ENV: rate or "unshaped"}
    if "A2A_LOCAL_SIZE" in os.environ:
        sys.exit(f"{module}: --cluster detects each node's ranks; unset A2A_LOCAL_SIZE "
                 f"(it is {os.environ['A2A_LOCAL_SIZE']}), which would emulate nodes instead")
    try:
        return cluster.run(nodes, ranks_per_node, [sys.executable, "-m", module, *argv], rate, env=env)
    except (RuntimeError, ValueError) as error:
        print(f"{module}: {error}", file=sys.stderr)
        return 2


def parse_with_quick(parser: Any, argv: list[str], quick: dict[str, Any]) -> Any:
    """parser.parse_args(argv); with --quick, the values of `quick` for the
    options that argv does not give."""
    given = {action.dest for action in parser._actions if any(option in argv for option in action.option_strings)}
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in quick.items():
            if name not in given:
                setattr(args, name, value)
    return args


def run_mode(module: str, flag: str, argv: list[str], args: Any, default_np: int, threads: int,
             bench: Callable[[Any, list[str]], int]) -> int:
    """A benchmark mode (`flag`, e.g. --flex, of `python -m module`): started
    plainly, it relaunches itself under mpirun on args.np ranks (default
    default_np, emulated as one node of them); under mpirun it runs
    bench(args, [flag, *argv]) on every rank with A2A_NUM_THREADS defaulting
    to `threads`."""
    from a2a import launch

    np = getattr(args, "np", None)
    if not launch.under_mpirun() and (np if np is not None else default_np) > 1:
        return relaunch(module, [flag, *argv], np, getattr(args, "local_size", None), default_np=default_np,
                        default_local_size=np or default_np)
    os.environ.setdefault("A2A_NUM_THREADS", str(threads))
    return on_every_rank(lambda: bench(args, [flag, *argv]))


def utc_timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: str, rows: list[dict]) -> None:
    """Every row of the run as one JSON list."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
        fh.write("\n")
