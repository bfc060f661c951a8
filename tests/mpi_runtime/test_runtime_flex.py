"""FlexMoE (MoELayer(flow=FlexConfig(...))): with any vExpert table the
layer equals the float64 reference (outputs and gradients) and, trained
with Adam through Expand / Shrink / Migrate, the plain dropless layer;
the primitives move parameters and optimizer state bitwise; replicas stay
bitwise identical; Algorithm 3 serves every choice once, locally first; the
scheduler decides the same on every rank whatever each rank's clock says;
bad or mismatched primitives fail on every rank."""

from __future__ import annotations

import os
import re
import time
import zlib

import numpy as np
import pytest
import torch
from runtime_util import (
    DEVICE,
    MODEL_DIM,
    NOTHING_DROPS,
    assert_matches,
    experts_spec,
    on_device,
    random_rows,
    reference,
    run_layer,
    suite_comm,
    tokens_of,
    two_level,
)

import a2a
import moe_runtime
from moe_runtime.common.host_values import all_gather_values
from moe_runtime.flex.routing import route
from moe_runtime.flex.vexperts import FREE, Expand, Migrate, Shrink


def make_layer(comm, num_experts, slots=None, flex=True, **options):
    gate = {"type": "top", "k": options.pop("k", 2)}
    config = moe_runtime.FlexConfig(slots_per_rank=slots, **options.pop("config", {})) if flex else None
    layer = moe_runtime.MoELayer(gate, MODEL_DIM, experts_spec(num_experts, comm.size), comm=comm, seeds=(41, 42),
                                 flow=config if flex else "dropless", **options)
    return on_device(layer, torch.float64)


def random_primitives(table, seed, count):
    """`count` valid primitives on `table` (the same on every rank for a seed):
    Shrink + Expand pairs (replicas on other ranks and on the same rank) and
    Migrates, and sometimes a lone Shrink that leaves a FREE slot."""
    rng = np.random.default_rng(seed)
    primitives, current = [], table
    while len(primitives) < count:
        slots = current.slots.reshape(-1)
        kind = rng.integers(3)
        if kind == 2:
            step = [Migrate(int(a), int(b)) for a, b in [rng.choice(slots.size, 2, replace=False)]]
        else:
            served = np.bincount(slots[slots != FREE], minlength=current.num_experts)
            shrinkable = [p for p in range(slots.size) if slots[p] != FREE and served[slots[p]] > 1]
            free = [p for p in range(slots.size) if slots[p] == FREE]
            if kind == 1 and free:
                step = [Expand(int(rng.integers(current.num_experts)), int(rng.choice(free)))]
            elif shrinkable:
                slot = int(rng.choice(shrinkable))
                step = [Shrink(slot)] + ([] if rng.random() < 0.2 else
                                         [Expand(int(rng.integers(current.num_experts)), slot)])
            else:
                continue
        current, _ = current.apply(step)
        primitives += step
    return primitives


def flex_cases(comm):
    """(E, slots per rank): one expert per rank with room for replicas, and two."""
    return [(comm.size, 2), (2 * comm.size, 3)]


def algos(comm):
    return ["linear", "2dh"] if two_level(comm) else ["linear"]


def gathered(tensor, comm):
    """(W, ...) of every rank's tensor."""
    return a2a.all_gather(tensor.detach().contiguous(), comm=comm).reshape(comm.size, *tensor.shape)


def test_the_initial_table_is_the_plain_layout_and_free_slots(comm):
    layer = make_layer(comm, 2 * comm.size, slots=3)
    want = np.full((comm.size, 3), FREE)
    want[:, :2] = np.arange(2 * comm.size).reshape(comm.size, 2)
    assert np.array_equal(layer.flex.table.slots, want)
    assert layer.flex.table.replica_groups() == []
    plain = make_layer(comm, 2 * comm.size, flex=False)
    for name, tensor in plain.gather_experts().items():
        assert torch.equal(layer.gather_experts()[name], tensor), name


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_layer_equals_the_reference_with_any_table(comm, seed):
    for num_experts, slots in flex_cases(comm):
        layer = make_layer(comm, num_experts, slots=slots)
        layer.adjust(random_primitives(layer.flex.table, seed, 6))
        want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS)
        for algo in algos(comm):
            what = f"E={num_experts} S={slots} seed={seed} {algo} table {layer.flex.table.slots.tolist()}"
            assert_matches(run_layer(layer, comm, torch.float64, algo=algo), want, 1e-12, what)


def test_routing_serves_every_choice_once_and_locally_first(comm):
    num_experts, slots = 2 * comm.size, 3
    layer = make_layer(comm, num_experts, slots=slots)
    layer.adjust(random_primitives(layer.flex.table, 7, 6))
    x = tokens_of(comm.rank, torch.float64)
    layer(x)
    demand, sends = layer.flex.last_demand, layer.flex.last_sends
    counts = np.bincount(layer.gates[0](x).topk(2, dim=1).indices.reshape(-1).cpu().numpy(), minlength=num_experts)
    assert np.array_equal(demand[comm.rank], counts)  # the gate's own counts, agreed
    assert np.array_equal(sends.sum(axis=2), demand.T)  # every choice sent exactly once
    replicas = layer.flex.table.replicas()
    target = sends.sum(axis=1)  # (E, W) rows each rank serves
    assert (target[replicas == 0] == 0).all()  # only ranks holding the expert serve it
    kept = np.einsum("egg->eg", sends)
    assert np.array_equal(kept, np.minimum(target, demand.T))  # locality first
    assert np.array_equal(sends, route(demand, replicas))
    assert layer.flex.history[-1]["loads"] == target.sum(axis=0).tolist()


def adam_step(layer, comm, optimizer, algo):
    out = run_layer(layer, comm, torch.float64, algo=algo)
    optimizer.step()
    return out


def test_training_through_adjustments_equals_the_plain_layer(comm):
    num_experts, slots = 2 * comm.size, 3
    flex, plain = make_layer(comm, num_experts, slots=slots), make_layer(comm, num_experts, flex=False)
    optimizers = [torch.optim.Adam(layer.parameters(), lr=0.01) for layer in (flex, plain)]
    algo = algos(comm)[-1]
    for step in range(4):
        if step in (1, 2):
            flex.adjust(random_primitives(flex.flex.table, 10 + step, 5), optimizers[0])
        got, want = (adam_step(layer, comm, optimizer, algo) for layer, optimizer in zip((flex, plain), optimizers))
        assert_matches(got, (*want, None), 1e-12, f"step {step}")
        for name, tensor in plain.gather_experts().items():
            error = float((flex.gather_experts()[name] - tensor).abs().max())
            assert error <= 1e-12, f"step {step}: {name} differs by {error:.3g}"


def slot_states(layer, optimizer, comm):
    """{name: (W S, ...)} every slot's parameters, gradients and Adam moments, gathered."""
    states = {}
    for name, parameter in layer.experts.named_parameters():
        states[name] = parameter
        states[name + ".grad"] = parameter.grad
        for key, value in optimizer.state[parameter].items():
            if value.dim() >= 1:
                states[f"{name}.{key}"] = value
    return {name: gathered(t, comm).reshape(-1, *t.shape[1:]) for name, t in states.items()}


def test_primitives_move_parameters_and_optimizer_state_bitwise(comm):
    num_experts, slots = 2 * comm.size, 3
    layer = make_layer(comm, num_experts, slots=slots)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.01)
    adam_step(layer, comm, optimizer, "linear")
    for seed in (21, 22):
        primitives = random_primitives(layer.flex.table, seed, 8)
        table, transfer = layer.flex.table.apply(primitives)
        before = slot_states(layer, optimizer, comm)
        moved = layer.adjust(primitives, optimizer)
        after = slot_states(layer, optimizer, comm)
        assert layer.flex.table == table
        for name in before:
            for slot in range(table.slots.size):
                if table.slots.reshape(-1)[slot] == FREE:
                    continue
                source = transfer.source[slot] if transfer.source[slot] >= 0 else slot
                assert torch.equal(after[name][slot], before[name][source]), f"{name} slot {slot} from {source}"
        sent = sum(count for (src, _), count in transfer.messages().items() if src == comm.rank)
        assert moved.experts_sent == sent


def test_a_call_without_backward_between_training_steps_is_no_sample(comm):
    """An inference call times no replica all-reduce: the next call must not
    hand its NaN replica seconds to the cost model (it raised there)."""
    layer = make_layer(comm, comm.size, slots=2)
    free = np.flatnonzero(layer.flex.table.slots.reshape(-1) == FREE)
    layer.adjust([Expand(int(slot // 2 + 1) % comm.size, int(slot)) for slot in free])
    assert layer.flex.table.replica_groups()
    x = tokens_of(comm.rank, torch.float64)
    with torch.no_grad():
        layer(x)
    for _ in range(2):  # the first takes no sample of the inference call; the second observes the first
        layer.zero_grad()
        (layer(x).square().sum()).backward()
    assert layer.flex.history[-1]["measured_s"] is None and layer.flex.history[-2]["measured_s"] is not None


def test_replicas_stay_bitwise_identical_through_training(comm):
    num_experts, slots = comm.size, 3  # every expert on 3 slots: several ranks, and twice on some
    layer = make_layer(comm, num_experts, slots=slots)
    free = np.flatnonzero(layer.flex.table.slots.reshape(-1) == FREE)
    layer.adjust([Expand(int(p) % num_experts, int(p)) for p in free])
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)
    replicated = [e for e, ranks in layer.flex.table.replica_groups()]
    assert replicated, "the table must replicate experts across ranks"
    for step in range(6):
        x = tokens_of(comm.rank, torch.float64) * (1 + step)
        layer.zero_grad()
        y = layer(x)
        (y.square().sum() + y.l_aux).backward()
        moe_runtime.sync_shared_gradients(layer, comm)
        optimizer.step()
    states = slot_states(layer, optimizer, comm)
    table = layer.flex.table.slots.reshape(-1)
    for expert in range(num_experts):
        slots_of = np.flatnonzero(table == expert)
        for name, tensor in states.items():
            for slot in slots_of[1:]:
                assert torch.equal(tensor[slot], tensor[slots_of[0]]), f"expert {expert} {name} slot {slot}"


SCHEDULED_DIM, SCHEDULED_HIDDEN = 32, 512  # with 640 rows per rank, enough compute that a replica pays for its
# sync even on a loaded host (160 rows left the scheduler idle at a load average of 10)


def skewed_tokens(comm, step):
    """Tokens most of which the layer's gate sends to expert 0 (a hot expert)."""
    return random_rows(640 + 3 * comm.rank, 300 + 7 * step + comm.rank, columns=SCHEDULED_DIM)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="needs the skew to make the scheduler act, which rests on the "
                    "host clock timing the experts' compute as heavier than a replica's all-reduce: true of these "
                    "small experts on the CPU; on CUDA the clock times kernel launches (ComputeClock does not "
                    "synchronize), so whether it acts depends on the GPU, not on the code under test")
def test_the_scheduler_decides_the_same_on_every_rank_under_timing_noise(comm):
    noise, drift = np.random.default_rng(1000 + comm.rank), [0.0]

    def noisy_clock():  # each rank's clock runs at its own rate and jumps forward at random
        drift[0] += float(noise.uniform(0, 1e-4))
        return time.perf_counter() * (1 + 0.1 * comm.rank) + drift[0]

    config = moe_runtime.FlexConfig(slots_per_rank=3, threshold=1.05, calibration_steps=2, horizon_steps=1000)
    spec = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": SCHEDULED_HIDDEN}
    layer = on_device(moe_runtime.MoELayer({"type": "top", "k": 2}, SCHEDULED_DIM, spec, comm=comm, seeds=(41, 42),
                                           flow=config, timer=noisy_clock), torch.float64)
    with torch.no_grad():
        layer.gates[0].wg.weight[0].add_(3.0)  # expert 0 scores higher on positive inputs
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.001)
    planned = 0
    for step in range(8):
        x = skewed_tokens(comm, step).abs()
        layer.zero_grad()
        y = layer(x)
        (y.square().sum() + y.l_aux).backward()
        moe_runtime.sync_shared_gradients(layer, comm)
        optimizer.step()
        decision = layer.rebalance(optimizer)
        digest = zlib.crc32(repr((decision.primitives if decision else None, layer.flex.table)).encode())
        digests = all_gather_values(np.array([digest], dtype=np.int64), comm)
        assert (digests == digests[0]).all(), f"step {step}: ranks decided differently"
        planned += len(decision.primitives) if decision else 0
    assert planned > 0, "the skew must make the scheduler act (else this test checks nothing)"
    assert layer.flex.history[-1]["balance_ratio"] < layer.flex.history[0]["balance_ratio"]


def test_errors_name_what_is_wrong_on_every_rank(comm):
    num_experts = comm.size
    # flex= without dispatcher="dropless" (deprecated keywords): tests/unit/test_runtime_settings.py
    layer = make_layer(comm, num_experts, slots=2)
    with pytest.raises(ValueError, match="use adjust"):
        layer.place(np.arange(num_experts).reshape(comm.size, -1))
    occupied = Expand(1, 0)  # slot 0 serves expert 0: Shrink first
    with pytest.raises(ValueError, match="Shrink it first"):
        layer.adjust([occupied])
    mine = [Migrate(0, 1)] if comm.rank == comm.size - 1 else [Migrate(0, 2)]
    with pytest.raises(a2a.MismatchError, match=f"ranks \\[{comm.size - 1}\\] passed a different primitives"):
        layer.adjust(mine)
    optimizer = torch.optim.Adam(layer.parameters())
    with pytest.raises(a2a.MismatchError, match="passed a different optimizer"):
        layer.adjust([Migrate(0, 1)], optimizer if comm.rank == 0 else None)
    assert np.array_equal(layer.flex.table.slots, moe_runtime.SlotTable.plain(num_experts, comm.size, 2).slots)
    plain = make_layer(comm, num_experts, flex=False)
    with pytest.raises(ValueError, match="MoELayer.rebalance is FlexMoE's"):
        plain.rebalance()


@pytest.mark.skipif(os.environ.get("A2A_TEST_FLEX_TIMEOUT") != "1",
                    reason="leaves messages in flight: run by tests/run_mpi.py's flexmoe-np2 only, last")
def test_an_adjustment_whose_peer_never_arrives_times_out_with_a_clear_error(world):
    """The last rank never calls adjust: every other rank's call raises a
    timeout naming it within the communicator's 1 s; the late rank's own
    call, once its peers have given up, fails too (timeout or retired
    communicator) instead of hanging."""
    missing = world.Get_size() - 1
    comm = suite_comm(world, timeout_s=1)
    layer = make_layer(comm, comm.size, slots=2)
    primitives = [Migrate(0, comm.size * 2 - 1)]
    world.Barrier()
    outcome = None
    if comm.rank != missing:
        start = time.monotonic()
        with pytest.raises(a2a.A2ATimeoutError) as error:
            layer.adjust(primitives)
        outcome = (str(error.value), time.monotonic() - start)
    world.Barrier()
    if comm.rank == missing:
        with pytest.raises(a2a.A2AError):
            layer.adjust(primitives)
    world.Barrier()
    if outcome is not None:
        message, seconds = outcome
        assert re.search(rf"\brank {missing}\b", message), message
        assert seconds < 30, f"the timeout took {seconds:.1f} s"
