"""What the benchmark families share: sizes, the clock, taking turns,
formatting and the JSON record of a run."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "COMMAND_ENV",
    "Clock",
    "command_line",
    "format_time",
    "geomean",
    "out_of_bounds_line",
    "parse_size",
    "relaunch",
    "strip_np",
    "take_turns",
    "utc_timestamp",
    "write_json",
]

COMMAND_ENV = "A2A_BENCH_COMMAND"  # the command line the user typed (set when relaunched under mpirun)

# ---------------------------------------------------------------------------
# Sizes

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from "64", "1K", "64M", "1G" (powers of 1024, as nccl-tests), also "1KB", "1KiB"."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(f"invalid size {text!r}; expected an integer with an optional K, M or G suffix")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


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


def take_turns(timings: list[Callable[[], float]], repeats: int) -> list[list[float]]:
    """`repeats` samples of each timing, taken in rounds in which they take
    turns: a busy moment on a shared machine hits all of them alike, so
    their ratios stay fair."""
    samples: list[list[float]] = [[] for _ in timings]
    for _ in range(repeats):
        for timing, taken in zip(timings, samples):
            taken.append(timing())
    return samples


# ---------------------------------------------------------------------------
# Output


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


def relaunch(module: str, argv: list[str], np: int | None, local_size: int | None, *, default_np: int,
             default_local_size: int) -> int:
    """Runs `python -m module argv` (without --np) on np ranks (default_np
    when None) under mpirun. With neither --np, --local-size nor
    A2A_LOCAL_SIZE, default_np ranks are emulated as nodes of
    default_local_size."""
    from a2a import launch

    ranks = np if np is not None else default_np
    env = {COMMAND_ENV: command_line(argv, module)}
    if local_size is None and np is None and "A2A_LOCAL_SIZE" not in os.environ and ranks % default_local_size == 0:
        local_size = default_local_size
    if local_size is not None:
        env["A2A_LOCAL_SIZE"] = str(local_size)
    try:
        return launch.run(ranks, [sys.executable, "-m", module, *strip_np(argv)], env=env)
    except FileNotFoundError as error:
        print(f"{module}: {error}", file=sys.stderr)
        return 2


def utc_timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: str, rows: list[dict]) -> None:
    """Every row of the run as one JSON list."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
        fh.write("\n")
