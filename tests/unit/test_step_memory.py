"""moe_runtime.bench.step_memory: the peak of a step's live CPU allocations, plus the pooled buffers."""

from __future__ import annotations

import torch

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
