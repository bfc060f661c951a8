"""FlexMoE's vExpert table (moe_runtime.flex.vexperts), Algorithm 3's routing
(moe_runtime.flex.routing) and FlexConfig, against hand-worked cases; the
layer with flow=FlexConfig(...) on one rank."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime.flex.routing import balance_ratio, rank_loads, route, variance_ratio
from moe_runtime.flex.vexperts import FREE, Expand, Migrate, Shrink, SlotTable


def test_route_by_hand():
    # One expert, one vExpert on each of 2 ranks, demand (5, 1): targets 6/2 = (3, 3);
    # rank 0 keeps 3 and sends its 2 others to rank 1, which keeps its 1.
    assert route([[5], [1]], [[1, 1]])[0].tolist() == [[3, 2], [0, 1]]
    # n = (2, 1, 0), demand (4, 2, 3) = 9: targets (6, 3, 0); keep (4, 2, 0); rank 2 spills 3
    # over the spare (2, 1) in proportion: 2 and 1.
    assert route([[4], [2], [3]], [[2, 1, 0]])[0].tolist() == [[4, 0, 0], [0, 2, 0], [2, 1, 0]]
    # n = (1, 1, 1), demand (7, 0, 0): 7/3 each, floors 2, the one left to the lowest rank: (3, 2, 2).
    assert route([[7], [0], [0]], [[1, 1, 1]])[0].tolist() == [[3, 2, 2], [0, 0, 0], [0, 0, 0]]


def test_two_spilling_ranks_share_the_spare_room_in_proportion():
    # 4 ranks, one vExpert each, demand (6, 6, 0, 0): targets 3 each. Rank 0 spills 3 over spare
    # (3, 3) on ranks 2, 3: 1.5 each, floors 1, the one left to rank 2: (2, 1); spare left (1, 2).
    # Rank 1 spills 3 over (1, 2): exactly (1, 2). Ranks 2 and 3 end with 3 each.
    sends = route([[6], [6], [0], [0]], [[1, 1, 1, 1]])[0]
    assert sends.tolist() == [[3, 0, 2, 1], [0, 3, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert rank_loads(sends[None]).tolist() == [3, 3, 3, 3]


def test_route_serves_every_choice_once_locally_first_on_random_tables():
    rng = np.random.default_rng(0)
    for _ in range(300):
        ranks, experts, slots = (int(v) for v in rng.integers(1, 7, 3))
        if ranks * slots < experts:
            continue
        table = SlotTable.round_robin(experts, ranks, slots)
        demand = rng.integers(0, 40, (ranks, experts)) * (rng.random((ranks, experts)) < 0.7)
        sends = route(demand, table.replicas())
        assert (sends >= 0).all() and np.array_equal(sends.sum(axis=2), demand.T)
        target = sends.sum(axis=1)
        exact = demand.sum(axis=0)[:, None] * table.replicas() / table.replicas().sum(axis=1, keepdims=True)
        assert (np.abs(target - exact) < 1).all()  # each rank within a choice of cap_e * n_{e,g}
        assert np.array_equal(np.einsum("egg->eg", sends), np.minimum(target, demand.T))


def test_balance_and_variance_ratios():
    assert balance_ratio([3, 1]) == pytest.approx(1.5)  # Equation 6: 3 / mean 2
    assert balance_ratio([0, 0]) == 1.0
    assert variance_ratio([3, 1]) == pytest.approx(0.25)  # variance 1 over mean^2 4
    assert variance_ratio([2, 2]) == 0.0


def test_route_errors():
    with pytest.raises(ValueError, match=r"replicas must be \(E, W\) = \(1, 2\)"):
        route([[1], [1]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="expert 0 has 2 choices but no vExpert serves it"):
        route([[1], [1]], [[0, 0]])
    with pytest.raises(ValueError, match="non-negative"):
        route([[-1], [1]], [[1, 1]])


def test_the_plain_table_has_free_slots_beyond_the_experts():
    assert SlotTable.plain(4, 2, 3).slots.tolist() == [[0, 1, FREE], [2, 3, FREE]]
    with pytest.raises(ValueError, match="needs E = n W and S >= n"):
        SlotTable.plain(4, 2, 1)


def test_the_initial_table_and_its_queries():
    table = SlotTable.round_robin(4, 2, 3)  # slot p holds p mod 4: [[0, 1, 2], [3, 0, 1]]
    assert table.slots.tolist() == [[0, 1, 2], [3, 0, 1]]
    assert table.replicas().tolist() == [[1, 1], [1, 1], [1, 0], [0, 1]]
    assert table.replica_groups() == [(0, (0, 1)), (1, (0, 1))]
    assert table.primary_slots(1).tolist() == [1, 2, -1, 0]
    assert table.slots_of(0) == [0, 4] and table.ranks_of(3) == [1]


def test_primitives_by_hand():
    table = SlotTable.round_robin(4, 2, 2)  # [[0, 1], [2, 3]]
    # Migrate slots 1 and 2: [[0, 2], [1, 3]]; both states cross ranks, one message each way.
    moved, transfer = table.apply([Migrate(1, 2)])
    assert moved.slots.tolist() == [[0, 2], [1, 3]]
    assert transfer.source.tolist() == [-1, 2, 1, -1] and transfer.messages() == {(0, 1): 1, (1, 0): 1}
    # With room for replicas: [[0, 1, 2], [3, 0, 1]]. Shrink slot 5 (expert 1 on rank 1), Expand
    # expert 2 there: its states come from slot 2 on rank 0. Then Shrink slot 4 (expert 0 on
    # rank 1) and Expand 2 there too: slot 2 is needed twice on rank 1 but sent once.
    wide = SlotTable.round_robin(4, 2, 3)
    after, transfer = wide.apply([Shrink(5), Expand(2, 5), Shrink(4), Expand(2, 4)])
    assert after.slots.tolist() == [[0, 1, 2], [3, 2, 2]]
    assert transfer.source.tolist() == [-1, -1, -1, -1, 2, 2] and transfer.messages() == {(0, 1): 1}
    # An Expand prefers a source on the destination's rank: no message.
    local, transfer = after.apply([Shrink(5), Expand(2, 5)])
    assert local.slots.tolist() == [[0, 1, 2], [3, 2, 2]] and transfer.source.tolist()[5] == 4
    assert transfer.messages() == {}
    # A lone Shrink leaves the slot FREE; nothing moves.
    freed, transfer = wide.apply([Shrink(0)])
    assert freed.slots.tolist() == [[FREE, 1, 2], [3, 0, 1]] and transfer.empty


def test_primitive_errors_name_the_primitive():
    table = SlotTable.round_robin(4, 2, 2)
    with pytest.raises(ValueError, match=r"primitive 0 \(Shrink\(slot=0\)\): slot 0 is the last one serving expert 0"):
        table.apply([Shrink(0)])
    with pytest.raises(ValueError, match="slot 1 serves expert 1; Shrink it first"):
        table.apply([Expand(0, 1)])
    with pytest.raises(ValueError, match=r"slot 9 is not in \[0, 4\)"):
        table.apply([Migrate(0, 9)])
    with pytest.raises(ValueError, match="every expert needs a slot; experts \\[3\\] have none"):
        SlotTable([[0, 1], [2, FREE]], 4)
    with pytest.raises(ValueError, match="cannot hold 5 experts"):
        SlotTable.round_robin(5, 2, 2)


def test_flex_config_checks_its_settings():
    assert moe_runtime.FlexConfig().slots_for(3) == 6
    with pytest.raises(ValueError, match="slots_per_rank=2 cannot hold the layer's 3 experts"):
        moe_runtime.FlexConfig(slots_per_rank=2).slots_for(3)
    with pytest.raises(ValueError, match="trigger must be one of"):
        moe_runtime.FlexConfig(trigger="max")
    with pytest.raises(ValueError, match="give a threshold >= 1"):
        moe_runtime.FlexConfig(threshold=0.5)
    with pytest.raises(ValueError, match="max_plans must be a positive integer"):
        moe_runtime.FlexConfig(max_plans=0)


def test_the_layer_on_one_rank_with_two_slots_of_an_expert(comm):
    """Two slots of expert 0 on one rank share its rows (the first computes);
    the gradient of both is the expert's, so an optimizer step keeps them equal."""
    layer = moe_runtime.MoELayer({"type": "top", "k": 2}, 6, {"type": "ffn", "num_experts_per_device": 3,
                                                              "hidden_size_per_expert": 5}, comm=comm, seeds=(1, 2),
                                 flow=moe_runtime.FlexConfig(slots_per_rank=4)).double()
    plain = moe_runtime.MoELayer({"type": "top", "k": 2}, 6, {"type": "ffn", "num_experts_per_device": 3,
                                                              "hidden_size_per_expert": 5}, comm=comm, seeds=(1, 2),
                                 flow="dropless").double()
    assert layer.flex.table.slots.tolist() == [[0, 1, 2, FREE]]
    layer.adjust([Expand(0, 3)])
    assert layer.flex.table.slots.tolist() == [[0, 1, 2, 0]]
    x = torch.randn(7, 6, dtype=torch.float64)
    y, want = layer(x), plain(x)
    assert torch.allclose(y, want, atol=1e-13, rtol=0)
    y.sum().backward()
    want.sum().backward()
    fc1 = layer.experts.batched_fc1_w
    assert torch.equal(fc1.grad[0], fc1.grad[3])
    assert torch.allclose(fc1.grad[:3], plain.experts.batched_fc1_w.grad, atol=1e-13, rtol=0)
