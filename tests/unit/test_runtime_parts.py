"""moe_runtime's parts on one process: capacity rules, losses, gates, the
buffer pool, chunk-major routing, host values through a communicator."""

from __future__ import annotations

import gc
import math

import pytest

torch = pytest.importorskip("torch")

import a2a
from moe_runtime.common.buffers import BufferPool
from moe_runtime.common.host_values import all_gather_values, all_reduce_values, torch_device
from moe_runtime.flows.expert import chunk_major
from moe_runtime.gating import capacity, gates, losses


@pytest.mark.parametrize("rule, factor, tokens, experts, k, want", [
    ("tutel", 1.2, 10, 4, 2, 6), ("a2a", 1.2, 10, 4, 2, 6),
    ("tutel", 0.75, 7, 4, 1, 1), ("a2a", 0.75, 7, 4, 1, 2),  # where the rules differ
    ("tutel", 1.0, 9, 4, 1, 3), ("a2a", 1.0, 9, 4, 1, 3),
    ("tutel", 0.01, 3, 4, 1, 1), ("a2a", 0.01, 3, 4, 1, 1),  # at least one row
])
def test_capacity_rules(rule, factor, tokens, experts, k, want):
    assert capacity.rule_capacity(rule, factor, tokens, experts, k) == want


def test_capacity_zero_and_negative_factors():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 has 4 choices
    assert capacity.local_capacity("tutel", 0.0, indices, 4) == 4
    assert capacity.local_capacity("tutel", -1.0, indices, 4) == 2  # min(4, k * floor(1 * ceil(4 / 4)))
    assert capacity.local_capacity("tutel", -0.5, indices, 4) == 1  # k * floor(0.5) = 0, at least 1
    assert capacity.local_capacity("tutel", -8.0, indices, 4) == 4
    with pytest.raises(ValueError, match="capacity_rule"):
        capacity.rule_capacity("other", 1.0, 4, 4, 1)
    assert capacity.buffer_capacity(10, 4) == 12 and capacity.buffer_capacity(12, 4) == 12


def test_gshard_loss_is_one_when_uniform():
    scores = torch.full((8, 4), 0.25, dtype=torch.float64)
    top = torch.arange(8).remainder(4).unsqueeze(1)
    assert float(losses.gshard_loss(scores, top)) == pytest.approx(1.0)
    skewed = torch.zeros(8, 1, dtype=torch.long)
    assert float(losses.gshard_loss(torch.eye(4, dtype=torch.float64)[[0] * 8], skewed)) == pytest.approx(4.0)


def test_load_importance_loss_needs_noise_and_is_zero_when_balanced():
    logits = torch.zeros(8, 4, dtype=torch.float64)
    scores = torch.softmax(logits, 1)
    with pytest.raises(ValueError, match="gate_noise"):
        losses.load_importance_loss(scores, logits, logits, 1, 0.0)
    assert float(losses.load_importance_loss(scores, logits, logits, 1, 1.0)) == pytest.approx(0.0, abs=1e-9)


def test_z_loss():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    want = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert float(losses.z_loss(logits)) == pytest.approx(want)


def test_gates_and_their_errors():
    gate = gates.make_gate({"type": "top", "k": 9}, 6, 4)
    assert gate.top_k == 4 and tuple(gate.wg.weight.shape) == (4, 6)  # k above E means E, as Tutel
    cosine = gates.make_gate({"type": "cosine_top", "k": 1, "proj_dim": 3}, 6, 4)
    cosine.reset_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(5, 6)
    proj = torch.nn.functional.normalize(cosine.cosine_projector(x), dim=1)
    sim = torch.nn.functional.normalize(cosine.sim_matrix, dim=0)
    want = proj @ sim * torch.clamp(cosine.temperature, max=math.log(100.0)).exp()
    assert torch.allclose(cosine(x), want)
    for bad, match in [({"type": "nope"}, "unknown type"), ({"k": 0}, "positive"), ({"x": 1}, "unknown keys"),
                       ({"type": "top", "proj_dim": 3}, "takes no")]:
        with pytest.raises(ValueError, match=match):
            gates.make_gate(bad, 6, 4)
    with pytest.raises(TypeError):
        gates.make_gate("top", 6, 4)


def test_decide_normalizes_gates_and_adds_z_loss():
    gate = gates.make_gate({"type": "top", "k": 2, "z_loss_coef": 0.5}, 6, 4)
    gate.reset_parameters(torch.Generator().manual_seed(1))
    x = torch.randn(7, 6, dtype=torch.float32)
    decision = gates.decide(gate, x, 2, training=False, normalize_gate=True, is_gshard_loss=True)
    assert torch.allclose(decision.gates.sum(1), torch.ones(7))
    logits = gate(x)
    want = losses.gshard_loss(decision.scores, decision.indices) + 0.5 * losses.z_loss(logits)
    assert torch.allclose(decision.l_aux, want)


def test_buffer_pool_reuses_sets_and_grows():
    pool = BufferPool()
    lease = pool.lease()
    a = lease.get("x", (4, 3), torch.float32, torch.device("cpu"))
    pointer = a.data_ptr()
    held = pool.lease()  # a second lease while the first is alive: a second set
    assert pool.sets_created == 2
    del lease, a
    gc.collect()
    again = pool.lease()
    assert again.get("x", (2, 5), torch.float32, torch.device("cpu")).data_ptr() == pointer
    assert again.get("x", (100,), torch.float32, torch.device("cpu")).numel() == 100  # grown
    assert pool.sets_created == 2
    del held, again
    gc.collect()
    [(name, address, size)] = pool.snapshot()  # both sets free; only the second holds a buffer
    assert (name, size) == ("x", 400) and address != pointer  # grown: a new buffer


def test_chunk_major_keeps_every_slot():
    torch.manual_seed(0)
    indices = torch.randint(0, 3, (20, 2))
    routing = a2a.route(indices, 3, capacity=6)
    layout = chunk_major(routing, indices, 3, 2, 3, None)
    locations, virtual = routing.locations, layout.locations
    kept = locations < 6
    chunk = torch.div(locations, 3, rounding_mode="floor")
    assert torch.equal(virtual[kept], locations[kept] - 3 * chunk[kept])
    assert torch.equal(layout.indices[kept], (chunk * 3 + indices)[kept])
    assert layout.num_dropped == 0 and int(layout.counts.sum()) == int(kept.sum())


def test_host_values_through_a_host_communicator(comm):
    """NumPy in, NumPy out (a CUDA communicator takes them as a tensor on its GPU: tests/gpu)."""
    import numpy as np

    assert torch_device(comm) == torch.device("cpu")
    row = np.array([3, -1, 7], dtype=np.int64)
    gathered = all_gather_values(row, comm)
    assert isinstance(gathered, np.ndarray) and gathered.tolist() == [3, -1, 7]
    reduced = all_reduce_values(np.array([0.5, 2.0]), comm, op="max")
    assert isinstance(reduced, np.ndarray) and reduced.tolist() == [0.5, 2.0]
