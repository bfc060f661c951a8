"""Tutel's custom gate ({'type': 'custom', 'module': cls}) on every rank:
made with each rank's own gate seed, it holds rank 0's values everywhere
(one model), and the layer equals the float64 reference routed by it. Runs
under mpirun and under torchrun (the job's default group)."""

from __future__ import annotations

import pytest
import torch

import a2a
import moe_runtime
from moe_runtime import moe as tutel_moe
from moe_runtime.moe import net
from moe_runtime.moe.communicator import communicator
from moe_runtime.reference import moe_reference

MODEL_DIM, HIDDEN = 8, 16


class Gate(torch.nn.Module):
    def __init__(self, model_dim, num_global_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.my_wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.my_wg(x)


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(5 + rank, MODEL_DIM, generator=torch.Generator().manual_seed(70 + rank), dtype=torch.float64)


def test_a_custom_gate_is_one_model_and_routes_as_the_reference():
    rank, size = net.get_world_rank(), net.get_world_size()
    layer = tutel_moe.moe_layer(gate_type={"type": "custom", "module": Gate, "top_k": 2}, model_dim=MODEL_DIM,
                                experts={"type": "ffn", "count_per_node": 1, "hidden_size_per_expert": HIDDEN},
                                seeds=(10 + rank, 20 + rank)).double()
    weight = layer.gates[0].my_wg.weight.detach()
    everyone = net.simple_all_gather(weight.reshape(1, -1))
    assert (everyone == everyone[0]).all(), "the ranks' gates differ"
    xs = [tokens(r) for r in range(size)]
    ys, _, _ = moe_reference(xs, weight, layer.gather_experts(), top_k=2, capacity_factor=1.0)
    torch.testing.assert_close(layer(xs[rank]), ys[rank], rtol=0, atol=1e-12)


def test_gates_that_differ_across_ranks_raise_on_every_rank():
    """A user's gate with another top_k on the last rank: the construction agreement tells every rank."""
    rank, size = net.get_world_rank(), net.get_world_size()
    gate = Gate(MODEL_DIM, size, top_k=1 if rank == size - 1 else 2)
    experts = {"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": HIDDEN}
    with pytest.raises((ValueError, a2a.A2AError), match="k"):
        moe_runtime.MoELayer(gate, MODEL_DIM, experts, comm=communicator(None, "cpu"), seeds=(1, 2))
    net.barrier()
