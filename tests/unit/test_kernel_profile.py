"""a2a.bench.kernel_profile: the ops of a step by self time, on the CPU
(the same call lists CUDA kernels on a GPU, in the GPU check's --gpu-step)."""

from __future__ import annotations

import torch

from a2a.bench.kernel_profile import format_profile, top_self_time


def test_the_largest_ops_of_a_step_come_first_with_their_counts_per_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        for _ in range(3):
            a.mm(b)
        a.add(1)

    profile = top_self_time(torch, step, device="cpu", top=2, steps=2)
    names = [row["name"] for row in profile["rows"]]
    assert names[0] == "aten::mm" and len(names) == 2
    assert profile["rows"][0]["calls"] == 3
    assert 0 < profile["rows"][0]["ms"] <= profile["busy_ms"]
    assert abs(sum(row["share"] for row in profile["rows"]) - sum(row["ms"] for row in profile["rows"])
               / profile["busy_ms"]) < 1e-9
    lines = format_profile("ours", profile, 1.5, "op")
    assert lines[0].startswith("#   ours:") and "of a 1.50 ms step" in lines[0] and "aten::mm" in lines[1]


def test_a_gpu_profile_lists_the_hosts_ops_after_its_kernels():
    rows = [{"name": "gemm", "ms": 0.2, "calls": 3.0, "share": 0.5}]
    profile = {"busy_ms": 0.4, "kernels": 9, "rows": rows,
               "host": {"busy_ms": 1.0, "kernels": 30, "rows": [{"name": "cudaLaunchKernel", "ms": 0.3,
                                                                 "calls": 40.0, "share": 0.3}]}}
    lines = format_profile("graphed", profile, 1.46, "kernel")
    assert "0.40 ms of kernel self time per step of a 1.46 ms step" in lines[0]
    assert lines[2].startswith("#   graphed, on the host: 1.00 ms of op self time per step,")
    assert "cudaLaunchKernel" in lines[3] and "x40" in lines[3]
