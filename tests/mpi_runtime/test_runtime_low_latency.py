"""The dropless flow's low-latency path (Dropless(low_latency_tokens=N)):
inference calls with at most N tokens on every rank go through
a2a.LowLatencyBuffer, with the plain dropless flow's results; calls that
record autograd somewhere, or that are bigger on some rank, take the plain
path on every rank."""

from __future__ import annotations

import pytest
import torch
from runtime_util import DEVICE, make_layer, tokens_of, whole_expert_cases

import moe_runtime


def pair(comm, num_experts, dtype, k, **options):
    plain = make_layer(comm, num_experts, dtype, k=k, flow="dropless", **options)
    fast = make_layer(comm, num_experts, dtype, k=k, flow=moe_runtime.Dropless(low_latency_tokens=20), **options)
    return plain, fast


@pytest.mark.parametrize("dispatch_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("k", [1, 2])
def test_small_inference_calls_match_the_plain_flow(comm, dtype, tolerance, k, dispatch_dtype):
    for num_experts in whole_expert_cases(comm):
        plain, fast = pair(comm, num_experts, dtype, k, dispatch_dtype=dispatch_dtype)
        for call in range(3):  # tokens differ per rank and per call, 0 included
            x = tokens_of(comm.rank, dtype)[: (comm.rank + call) % 8]
            with torch.no_grad():
                want, got = plain(x), fast(x)
            assert fast.last_plan.low_latency and not plain.last_plan.low_latency
            assert got.shape == x.shape
            error = float((got - want).abs().max()) if x.numel() else 0.0
            assert error <= tolerance * max(1.0, float(want.abs().max()) if x.numel() else 1.0), \
                f"E={num_experts} k={k} call {call}: {error}"


def test_training_and_big_calls_take_the_plain_path(comm):
    num_experts = whole_expert_cases(comm)[0]
    plain, fast = pair(comm, num_experts, torch.float64, 2)
    x = tokens_of(comm.rank, torch.float64).requires_grad_(comm.rank == 0)  # one rank records: all go plain
    y = fast(x)
    assert not fast.last_plan.low_latency
    torch.testing.assert_close(y, plain(x), rtol=0, atol=1e-12)
    big = torch.randn(21 if comm.rank == comm.size - 1 else 3, 8, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        fast(big)
    assert not fast.last_plan.low_latency  # one rank's 21 tokens are above 20
