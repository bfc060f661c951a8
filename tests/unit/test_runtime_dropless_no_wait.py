"""MoELayer(flow=Dropless(wait=False)) on one rank: the dropless step that
reads nothing back (a2a.permute(..., wait=False), the experts' grouped GEMMs
by offsets on the device). SGD steps equal to the waiting flow's, bit for
bit, in float32 and bfloat16 (the grouped GEMMs on the CPU); no host wait
in a step; the plan's capacity T; and the settings it refuses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from checks import counting_alone

import moe_runtime
from moe_runtime import Dropless, ExpertCache

T, M, H, E = 24, 64, 32, 4


def make_layer(comm, dtype, **settings):
    gate = {"type": "top", "k": 2, "capacity_factor": 0.0}
    experts = {"type": "ffn", "num_experts_per_device": E, "hidden_size_per_expert": H}
    return moe_runtime.MoELayer(gate, M, experts, comm=comm, seeds=(1, 2), flow=Dropless(**settings)).to(dtype)


def train(layer, dtype, steps=3):
    """Each step's output, the input's last gradient, and each step's host waits."""
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    outputs, waits = [], []
    for _ in range(steps):
        with counting_alone() as cost:
            y = layer(x)
            (y.float().square().sum() + y.l_aux).backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(y.detach())
        waits.append(cost.counters.host_waits)
    return outputs, x.grad, waits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_is_the_waiting_flows_bit_for_bit_without_a_wait(comm, dtype):
    waited, waited_grad, waits = train(make_layer(comm, dtype), dtype)
    layer = make_layer(comm, dtype, wait=False)
    got, got_grad, no_waits = train(layer, dtype)
    for step, (a, b) in enumerate(zip(got, waited, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert torch.equal(got_grad, waited_grad)
    assert waits == [1, 1, 1] and no_waits == [0, 0, 0], (waits, no_waits)
    assert layer.last_plan.capacity == T  # the bound: the counts stay on the device


def test_rows_the_grouped_gemms_do_not_take_fail_naming_them(comm):
    layer = make_layer(comm, torch.float64, wait=False)
    with pytest.raises(RuntimeError, match="grouped GEMM.*float64"):
        layer(torch.randn(T, M, dtype=torch.float64))


@pytest.mark.parametrize("settings, words", [
    ({"low_latency_tokens": 4}, "low_latency_tokens"),
    ({"wait": 0}, "wait must be True or False"),
])
def test_settings_that_need_the_counts_are_refused(settings, words):
    with pytest.raises((ValueError, TypeError), match=words):
        Dropless(wait=settings.pop("wait", False), **settings)


def test_an_expert_cache_is_refused():
    cache = ExpertCache(num_slots=2)
    with pytest.raises(ValueError, match="expert_cache"):
        Dropless(wait=False, expert_cache=cache)


def test_fp8_dispatch_is_refused(comm):
    with pytest.raises(ValueError, match="one rank and no dispatch_dtype"):
        moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 0.0}, M,
                             {"type": "ffn", "num_experts_per_device": E, "hidden_size_per_expert": H}, comm=comm,
                             seeds=(1, 2), flow=Dropless(wait=False), dispatch_dtype="float8_e4m3fn")


def test_a_call_without_tokens(comm):
    layer = make_layer(comm, torch.float32, wait=False)
    x = torch.randn(0, M, requires_grad=True)
    y = layer(x)
    (y.sum() + y.l_aux).backward()
    assert y.shape == (0, M) and x.grad.shape == (0, M)
