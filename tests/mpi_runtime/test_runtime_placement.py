"""MoELayer.place (the Deployment paper's expert placement, Section VII):
the layer computes the same function after a placement (both dispatchers,
r = 0 and r = 1, linear and 2DH), the experts and their Adam state land
where the assignment says, bitwise, training continues as without the
placement, and bad or mismatched assignments fail on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_util import MODEL_DIM, assert_matches, experts_spec, on_device, reference, run_layer, two_level

import a2a
import moe_runtime
from moe_runtime.common.host_values import all_reduce_values


def make_layer(comm, num_experts, **options):
    gate = {"type": "top", "k": 2, "capacity_factor": options.pop("capacity_factor", 1.0)}
    layer = moe_runtime.MoELayer(gate, MODEL_DIM, experts_spec(num_experts, comm.size), comm=comm, seeds=(31, 32),
                                 **options)
    return on_device(layer, torch.float64)


def expert_counts(comm):
    """Whole experts on every rank: n = 1 and n = 2."""
    return [comm.size, 2 * comm.size]


def shuffled(num_experts, ranks, seed):
    """A (W, n) assignment that moves most experts to another rank (the same on every rank)."""
    order = np.random.default_rng(seed).permutation(num_experts).reshape(ranks, -1)
    if (order // order.shape[1] == np.arange(ranks)[:, None]).all():  # none moves (2 experts, 2 ranks may draw it)
        order = np.roll(order, 1, axis=0)
    return order


def total(comm, value):
    return int(all_reduce_values(np.array([value], dtype=np.int64), comm)[0])


def configurations(comm):
    """(flow, call arguments) of every path place must keep."""
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    cases = [("expert", {"adaptive_r": 0})]
    cases += [("expert", {"adaptive_r": 1, "algo": a}) for a in algos]
    cases += [("dropless", {"algo": a}) for a in algos]
    return cases


@pytest.mark.parametrize("flow", ["expert", "dropless"])
def test_the_layer_computes_the_same_function_after_place(comm, flow):
    for num_experts in expert_counts(comm):
        # f = 1.0 drops some choices: the same ones must drop after the placement
        layer = make_layer(comm, num_experts, flow=flow)
        calls = [call for name, call in configurations(comm) if name == flow]
        before = [run_layer(layer, comm, torch.float64, **call) for call in calls]
        assignment = shuffled(num_experts, comm.size, seed=num_experts)
        moved = layer.place(assignment)
        assert np.array_equal(layer.placement, assignment)
        changed = int((assignment.reshape(-1).argsort() // (num_experts // comm.size) !=
                       np.arange(num_experts) // (num_experts // comm.size)).sum())
        assert total(comm, moved.experts_sent) == changed > 0
        for call, want in zip(calls, before):
            what = f"{flow} E={num_experts} {call} after place"
            assert_matches(run_layer(layer, comm, torch.float64, **call), want, 1e-12, what)
        want = reference(layer, comm, torch.float64, capacity_factor=1000.0 if flow == "dropless" else 1.0)
        assert_matches(run_layer(layer, comm, torch.float64, **calls[-1]), want, 1e-12, f"{flow} reference")


def _whole_state(layer, optimizer, comm):
    """{(parameter, key): (E, ...) whole tensor in position order} of the parameters and their Adam state."""
    whole = {}
    for name, p in layer.experts.named_parameters():
        for key, tensor in [("value", p.detach()), *optimizer.state[p].items()]:
            if tensor.dim() >= 1:
                whole[name, key] = a2a.all_gather(tensor.contiguous(), comm=comm)
            else:
                whole[name, key] = tensor.clone()
    return whole


def test_experts_and_adam_state_land_where_the_assignment_says_bitwise(comm):
    for num_experts in expert_counts(comm):
        layer = make_layer(comm, num_experts)
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.01)
        run_layer(layer, comm, torch.float64)
        optimizer.step()
        before = _whole_state(layer, optimizer, comm)  # identity placement: position = logical id
        assignment = shuffled(num_experts, comm.size, seed=7)
        moved = layer.place(assignment, optimizer)
        per_expert = sum(t[0].numel() * t.element_size() for (_, _), t in before.items() if t.dim() >= 1)
        per_expert += sum(p.grad[0].numel() * p.grad.element_size() for p in layer.experts.parameters())
        assert moved.bytes_sent == moved.experts_sent * per_expert
        for name, p in layer.experts.named_parameters():
            state = optimizer.state[p]
            for slot, expert in enumerate(assignment[comm.rank]):
                assert torch.equal(p.detach()[slot], before[name, "value"][expert]), (name, slot, expert)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[key][slot], before[name, key][expert]), (name, key, slot)
            assert torch.equal(state["step"], before[name, "step"])


def test_a_training_step_after_place_equals_one_without(comm):
    num_experts = 2 * comm.size
    placed, plain = make_layer(comm, num_experts), make_layer(comm, num_experts)
    optimizers = [torch.optim.Adam(layer.parameters(), lr=0.01) for layer in (placed, plain)]
    for step in range(3):
        if step == 1:
            placed.place(shuffled(num_experts, comm.size, seed=11), optimizers[0])
        outputs = []
        for layer, optimizer in zip((placed, plain), optimizers):
            outputs.append(run_layer(layer, comm, torch.float64, algo="2dh" if two_level(comm) else "linear"))
            optimizer.step()
        assert_matches(outputs[0], outputs[1], 1e-12, f"step {step}")
        for name, tensor in plain.gather_experts().items():
            error = float((placed.gather_experts()[name] - tensor).abs().max())
            assert error <= 1e-12, f"step {step}: {name} differs by {error:.3g}"


def test_bad_or_mismatched_assignments_fail_on_every_rank(comm):
    num_experts = 2 * comm.size
    layer = make_layer(comm, num_experts)
    good = shuffled(num_experts, comm.size, seed=3)
    bad = good.copy()
    bad[0, 0] = bad[-1, -1]  # one expert twice, one missing
    if comm.rank == 1:
        with pytest.raises(ValueError, match="rank 1: assignment must hold every expert exactly once"):
            layer.place(bad)
    else:
        with pytest.raises(a2a.RemoteError, match=r"assignment or optimizer of rank\(s\) \[1\] is invalid"):
            layer.place(good)
    other = good[::-1].copy() if comm.rank == comm.size - 1 else good
    with pytest.raises(a2a.MismatchError, match=f"ranks \\[{comm.size - 1}\\] passed a different assignment"):
        layer.place(other)
    optimizer = torch.optim.Adam(layer.parameters())
    with pytest.raises(a2a.MismatchError, match="ranks .* passed a different optimizer"):
        layer.place(good, optimizer if comm.rank == 0 else None)
    assert np.array_equal(layer.placement, np.arange(num_experts).reshape(comm.size, -1))  # nothing moved
    shared = make_layer(comm, comm.size // 2)  # 2 ranks share each expert
    with pytest.raises(ValueError, match="2 ranks share each of the"):
        shared.place(np.arange(comm.size // 2).reshape(1, -1))
