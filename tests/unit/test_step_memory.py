"""moe_runtime.bench.step_memory: the peak of a step's live CPU allocations, plus the pooled buffers."""

from __future__ import annotations

import os
import sys

import torch

from a2a.bench.profiler_chatter import is_chatter
from moe_runtime.bench.step_memory import peak_step_bytes
from moe_runtime.common.buffers import BufferPool

MIB4 = 1000 * 1000 * 4  # a (1000, 1000) float32


def test_the_peak_is_the_most_live_at_once_not_the_sum_of_allocations():
    x = torch.randn(1000, 1000, requires_grad=True)

    def step():
        y = (x @ x).relu()  # x @ x and relu's output live at once: 2 matrices
        y.sum().backward()  # then the gradients, after the product is freed
        x.grad = None

    peak = peak_step_bytes(step)
    assert 2 * MIB4 <= peak < 3 * MIB4


def test_pooled_buffers_count_though_a_warm_step_does_not_allocate_them():
    pool = BufferPool()
    lease = pool.lease()
    lease.get("dispatch", (1000, 1000), torch.float32, torch.device("cpu"))
    del lease  # back in the pool

    def step():
        buffer = pool.lease().get("dispatch", (1000, 1000), torch.float32, torch.device("cpu"))
        buffer.fill_(1.0)

    assert peak_step_bytes(step) < MIB4 <= peak_step_bytes(step, pool) < MIB4 + 4096


def test_the_profilers_own_lines_stay_off_stderr(capfd):
    """torch.profiler's chatter on fd 2 (kineto's profiler_start/stop, the CPU
    allocator's warning) would land in the middle of a benchmark's tables."""
    held = [torch.randn(100, 100)]  # freed inside the profile: the allocator's warning
    peak_step_bytes(held.clear)
    x = torch.randn(100, 100)
    peak_step_bytes(lambda: (x @ x).sum())
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if "profiler_st" in line or "CPUAllocator" in line], err


def test_other_lines_on_stderr_during_the_step_still_come_out(capfd):
    def step():
        os.write(2, b"a real error from the step\n")
        print("and a Python one", file=sys.stderr, flush=True)

    peak_step_bytes(step)
    err = capfd.readouterr().err
    assert "a real error from the step\n" in err and "and a Python one\n" in err


def test_the_chatter_is_the_profilers_lines_and_nothing_else():
    chatter = [
        "USDT:2026-11-26 16:36:17 13925:13925 SyncActivityProfilerHandler.cpp:52] profiler_start",
        "USDT:2026-11-26 16:36:17 13925:13925 SyncActivityProfilerHandler.cpp:59] profiler_stop",
        ("[W1126 16:36:17.006301666 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the "
         "profiling started, profiler results will not include the deallocation event"),
    ]
    assert all(is_chatter(line) for line in chatter)
    assert not any(is_chatter(line) for line in (
        "[W1126 16:36:17.006301666 CPUAllocator.cpp:245] out of memory",
        "USDT: profiler_start and then a traceback",
        "RuntimeError: profiler_stop",
        "",
    ))
