"""Peak memory of one training step, for the benchmarks.

On CUDA the caching allocator counts its peak: the step's peak is that
counter, reset before the step, less what was allocated then. The CPU
allocator has no peak counter, so there the step runs under
``torch.profiler`` with ``profile_memory=True``: every op's allocations and
frees (its self memory) in time order make the live-bytes curve of the step,
and its maximum is the peak above what was live when the step began. The
layer's pooled buffers (moe_runtime.common.buffers) are reused from step to step, so
a warm step allocates none of them: their bytes are added, since the step
needs them as much as what it allocates. The profiler's own lines on
stderr are held back (a2a/bench/profiler_chatter.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from a2a.bench.profiler_chatter import without_profiler_chatter

from ..common.buffers import BufferPool

__all__ = ["peak_step_bytes"]


def peak_step_bytes(step: Callable[[], None], pool: BufferPool | None = None,
                    device: torch.device | str = "cpu") -> int:
    """Bytes: the peak of the step's live allocations on `device` (cpu, or a
    CUDA device) plus the pool's buffers."""
    pooled = sum(size for _, _, size in pool.snapshot()) if pool is not None else 0
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before + pooled
    with without_profiler_chatter(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = itertools.accumulate((e.self_cpu_memory_usage for e in events), initial=0)
    return max(live) + pooled
