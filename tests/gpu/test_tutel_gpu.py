"""Tutel's surface on one GPU: the layer built on the CPU and moved with
.cuda() (as Tutel's programs do) follows its tokens to a NCCL communicator
and computes what it computes on the CPU; bfloat16 under autocast with
fp32_gate; Tutel's helloworld trains on the GPU with its loss falling."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from moe_runtime import moe as tutel_moe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layer(**gate):
    return tutel_moe.moe_layer(gate_type={"type": "top", "k": 2, **gate}, model_dim=32,
                               experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 64},
                               seeds=(1, 2, 3))


def test_a_layer_moved_to_the_gpu_follows_its_tokens():
    layer = _layer()
    x = torch.randn(6, 10, 32, generator=torch.Generator().manual_seed(0))
    on_cpu = layer(x)
    assert layer.comm.device == "cpu"
    layer.cuda()
    on_gpu = layer(x.cuda())
    assert layer.comm.device == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-4, atol=1e-5)
    on_gpu.sum().backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in layer.parameters())


def test_bfloat16_under_autocast_with_an_fp32_gate():
    layer = _layer(fp32_gate=True).cuda()
    x = torch.randn(6, 10, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference = layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32  # the input's dtype, as Tutel
    torch.testing.assert_close(y, reference, rtol=0.05, atol=0.05)


def test_the_helloworld_trains_on_the_gpu():
    command = [sys.executable, os.path.join(ROOT, "examples", "tutel", "helloworld.py"), "--device", "cuda",
               "--num_steps", "10"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"^STEP-\d+: loss = ([0-9.]+)", done.stdout, re.MULTILINE)]
    assert len(losses) == 10 and losses[-1] < losses[0] / 2, losses
