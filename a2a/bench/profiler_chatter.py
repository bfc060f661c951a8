"""torch.profiler's own lines on the process's stderr, held back.

On the CPU, every profile started and stopped writes lines to fd 2 from C++,
past Python's ``sys.stderr``: kineto's ``USDT: ... profiler_start`` and
``profiler_stop``, and c10's ``CPUAllocator ... Memory block of unknown
size`` warning (a block allocated before the profile was freed in it: the
profile is of one step, so that is expected). Under mpirun they land in the
middle of the benchmarks' tables. :func:`without_profiler_chatter` sends fd 2
to a file around the profiled region and writes back every line that is not
one of those, so a real error still reaches stderr (after the region).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["is_chatter", "without_profiler_chatter"]

CHATTER = (
    re.compile(r"^USDT:.* SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$"),
    re.compile(r"^\[W.* CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling "
               r"started, profiler results will not include the deallocation event$"),
    re.compile(r"^STAGE:.* ActivityProfilerController\.cpp:\d+\] Completed Stage: [\w ]+$"),  # older kineto
)


def is_chatter(line: str) -> bool:
    """Whether `line` (without its newline) is one of the profiler's known lines."""
    return any(pattern.match(line) for pattern in CHATTER)


@contextlib.contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """fd 2 goes to a file inside the block; on leaving it, the lines that are
    not the profiler's chatter are written to the real fd 2, in order."""
    sys.stderr.flush()
    real = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(real, 2)
            os.close(real)
            held.seek(0)
            kept = b"".join(line for line in held
                            if not is_chatter(line.decode(errors="replace").rstrip("\r\n")))
            while kept:
                kept = kept[os.write(2, kept):]
