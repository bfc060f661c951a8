"""tools/overhead_floor.py's floor computes what the layer computes: its loss
and gradients are the layer's (the tool checks this before timing), and a
layer loss that differs stops the tool instead of timing another math."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

from moe_runtime import MoELayer
from moe_runtime.bench.overhead import _sum_and_l_aux

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "overhead_floor.py"


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("overhead_floor", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tokens,experts", [(16, 2), (37, 4)])
def test_the_floor_has_the_layers_loss_and_gradients(comm, floor, tokens, experts):
    torch.manual_seed(tokens)
    layer = MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, 32,
                     {"type": "ffn", "count_per_node": experts, "hidden_size_per_expert": 48,
                      "has_fc1_bias": False, "has_fc2_bias": False}, comm=comm, seeds=(1, 2))
    x = torch.randn(tokens, 32, requires_grad=True)
    layer_loss = _sum_and_l_aux(layer, x)
    layer_loss()
    assert layer.last_plan.buffer_capacity == layer.last_plan.capacity
    _, check = floor.floor_step(layer, x, layer.last_plan.capacity)
    check(layer_loss)  # raises SystemExit where any of them differs
    with pytest.raises(SystemExit, match="the floor's loss differs"):
        check(lambda: layer_loss() * 1.001)
