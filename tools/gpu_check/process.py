"""One command held to a time budget: its output into a log, and past the
budget SIGTERM, then SIGKILL, for its whole process group and for every
process that carries its marker variable (mpirun's ranks leave the process
group, but inherit the environment). The build and every stage run through
it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import IO

MARKER = "A2A_GPU_CHECK_STEP"
TERM_GRACE_S = 5


def stray_processes(marker: str) -> list[int]:
    """Processes whose environment carries marker (the command's own, at any depth)."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def stop(process: subprocess.Popen, marker: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in (process.pid, *stray_processes(marker)):
            try:
                if target == process.pid:
                    os.killpg(process.pid, sig)
                else:
                    os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            process.wait(timeout=TERM_GRACE_S)
            if not stray_processes(marker):
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)


@dataclass
class Held:
    """A started command: wait() holds it to a budget counted from the wait."""
    process: subprocess.Popen
    marker: str

    def wait(self, timeout_s: float) -> int | None:
        """Its exit status, or None when it ran past timeout_s (it is stopped
        then, with the processes it started)."""
        try:
            return self.process.wait(timeout=max(timeout_s, 0))
        except subprocess.TimeoutExpired:
            stop(self.process, self.marker)
            return None


def start_held(argv: list[str], *, cwd: os.PathLike, env: dict[str, str], log: IO[str]) -> Held:
    """Starts argv with its output in log, in a session of its own."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    process = subprocess.Popen(argv, cwd=cwd, env=dict(env, **{MARKER: marker}), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return Held(process, marker)


def run_held(argv: list[str], *, cwd: os.PathLike, env: dict[str, str], log: IO[str], timeout_s: float) -> int | None:
    """Runs argv with its output in log; its exit status, or None when it ran
    past timeout_s (it is stopped then, with the processes it started)."""
    return start_held(argv, cwd=cwd, env=env, log=log).wait(timeout_s)
