"""The layer across torch's modes, in the order a training job mixes them:
a call under torch.inference_mode() (an evaluation, a generation), one
under torch.no_grad(), training steps, then torch.no_grad() and inference
mode again. What a call
keeps for later ones (pooled buffers, the low-latency path's and the expert
cache's tensors, the shared expert cache, a placement) is made of normal
tensors, never inference tensors, which a later call outside inference mode
could not write ("Inplace update to inference tensor outside InferenceMode":
the default flow failed so, after one evaluation under inference_mode).
Every call equals the same call on a layer that ran in one mode only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_util import MODEL_DIM, on_device, random_rows

import moe_runtime

HIDDEN = 24


def layouts() -> dict[str, tuple[dict, int, float]]:
    """name -> (options, experts per rank, capacity factor)."""
    return {
        "expert": ({}, 2, 1.0),
        "expert-d2": ({"a2a_ffn_overlap_degree": 2}, 2, 1.0),
        "dictionary": ({"parallel_type": "adaptive:auto"}, 2, 1.0),
        "fp8": ({"dispatch_dtype": "float8_e4m3fn"}, 2, 1.0),
        "dropless": ({"flow": "dropless"}, 2, 0.0),
        "low-latency": ({"flow": moe_runtime.Dropless(low_latency_tokens=64)}, 2, 0.0),
        "expert-cache": ({"flow": moe_runtime.Dropless(expert_cache=moe_runtime.ExpertCache(1))}, 2, 0.0),
        "dynamic": ({"flow": "dynamic"}, 2, 1.0),
        "flex": ({"flow": moe_runtime.FlexConfig(slots_per_rank=2)}, 1, 1.0),
        "data_centric": ({"flow": "data_centric"}, 1, 1.0),
        "model_centric": ({"flow": "model_centric"}, 1, 1.0),
    }


def build(comm, layout: str) -> moe_runtime.MoELayer:
    options, experts, factor = layouts()[layout]
    layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": factor}, MODEL_DIM,
                                 {"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": HIDDEN},
                                 comm=comm, seeds=(8, 9), **options)
    return on_device(layer, torch.float32)


def placed(comm, layer) -> None:
    """Every expert one rank further on (a placement the layer maps at dispatch)."""
    if layer.flow.name == "expert" and layer.experts.sharers == 1 and comm.size > 1:
        layer.place(np.roll(layer.placement, 1, axis=0))


@pytest.mark.parametrize("layout", list(layouts()))
def test_inference_mode_then_training_then_no_grad_equals_each_mode_alone(comm, layout):
    mixed, trained, inferred = build(comm, layout), build(comm, layout), build(comm, layout)
    for layer in (mixed, trained, inferred):
        placed(comm, layer)
    x = random_rows(10 + comm.rank, 40 + comm.rank, dtype=torch.float32)
    with torch.inference_mode():
        first = mixed(x)
        assert torch.equal(first, inferred(x))
    with torch.no_grad():  # writes what the inference-mode call made (the expert cache's slots)
        assert torch.equal(mixed(x), first)
    for layer in (mixed, trained):
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            y = layer(x)
            (y.square().mean() + y.l_aux).backward()
            optimizer.step()
    for got, want in zip(mixed.parameters(), trained.parameters(), strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(mixed(x), trained(x))
    with torch.inference_mode():
        assert torch.equal(mixed(x), trained(x))
