"""copy.deepcopy of a layer on every rank (moe_runtime/common/copying.py),
used as an EMA is: the model trains, its copy follows it by an exponential
moving average and runs inference every step, both over one communicator.
The model trains bitwise as a twin that was never copied (the copy's calls
between its steps change nothing of its state), and the copy computes what
a layer built from its state_dict computes. One rank's view of it:
tests/unit/test_runtime_copy.py."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_util import MODEL_DIM, on_device, random_rows

import moe_runtime

HIDDEN = 24


def layouts() -> dict[str, tuple[dict, int]]:
    return {
        "expert": ({}, 2),
        "expert-d2": ({"a2a_ffn_overlap_degree": 2}, 2),
        "dropless": ({"flow": "dropless"}, 2),
        "low-latency": ({"flow": moe_runtime.Dropless(low_latency_tokens=64)}, 2),
        "dynamic": ({"flow": "dynamic"}, 2),
        "flex": ({"flow": moe_runtime.FlexConfig(slots_per_rank=2)}, 1),
        "data_centric": ({"flow": "data_centric"}, 1),
        "model_centric": ({"flow": "model_centric"}, 1),
    }


def build(comm, layout: str) -> moe_runtime.MoELayer:
    options, experts = layouts()[layout]
    layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, MODEL_DIM,
                                 {"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": HIDDEN},
                                 comm=comm, seeds=(3, 4), **options)
    return on_device(layer, torch.float64)


def train_step(layer, optimizer, x) -> None:
    optimizer.zero_grad()
    y = layer(x)
    (y.square().mean() + y.l_aux).backward()
    optimizer.step()


@pytest.mark.parametrize("layout", list(layouts()))
def test_an_ema_copy_follows_the_model_without_changing_its_training(comm, layout):
    model, twin = build(comm, layout), build(comm, layout)
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in (model, twin)]
    batches = [random_rows(9 + 2 * comm.rank + step, 300 * step + comm.rank) for step in range(4)]
    train_step(model, optimizers[0], batches[0])
    train_step(twin, optimizers[1], batches[0])
    ema = copy.deepcopy(model)
    for x in batches[1:]:
        train_step(model, optimizers[0], x)
        train_step(twin, optimizers[1], x)
        with torch.no_grad():
            for average, current in zip(ema.parameters(), model.parameters(), strict=True):
                average.mul_(0.75).add_(current, alpha=0.25)
            y = ema(x)
    for (key, got), want in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(got, want), f"{layout}: the copied model's {key} trained otherwise than its twin's"
    loaded = build(comm, layout)
    loaded.load_state_dict(ema.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(batches[-1]), y), f"{layout}: the copy's output"
