"""What one MoELayer training step (forward and backward) costs on one rank,
held as budgets: the host overhead a GPU step pays, visible on the CPU
through the same code. Per step after warm-up, at a capacity factor f > 0:

- no host wait: a2a counts none (route reads nothing back: wait=False), and
  the step reads no tensor value on the host (torch's _local_scalar_dense,
  behind item(), int() and bool() of a tensor, and the ops whose output size
  depends on values, such as bincount: a stream sync on a GPU each);
- at most BUDGET torch ops dispatched (each a launch on a GPU, or a view's
  host work), native calls and allocations: a change that adds any fails
  here, on a CPU, and must raise its budget on purpose.

At f <= 0 the capacity is the largest demand, read once per step (the one
host wait the issue allows for data-dependent sizes); with
dropless_capacity="worst_case", at f == 0, it is T, and nothing is read."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from checks import counting_alone

import moe_runtime
from moe_runtime import Dropless
from moe_runtime.bench.dispatched import DispatchedOps
from moe_runtime.bench.overhead import SIZED_BY_VALUES

T, M, H = 16, 64, 64

# case: (layer options, call options, budget). Measured 2026-11-29 (torch 2.13, CPU); before route stopped
# waiting, one rank stopped exchanging with itself, an untimed step stopped timing and an exact buffer stopped
# being sliced, f=1 was 158 ops, 17 native calls, 8 allocations, 1 wait; 130 ops before the reshapes that
# change no shape were left out (the tokens, the gathered experts, a new kernel result, the output) and
# route's private copy of the indices stopped detaching a tensor that records no gradient; 11 more before the
# gate's softmax, top-k, gates and loss became one autograd node (gating/topk.py); 1 more (2 at d = 2) before
# relu's backward became one threshold_backward in place (experts/activation.py); 19 more before that node
# ran a2a's fused gate, one native call each way (a2a.top_k_gate), which added 2 native calls and 7
# allocations (the gate's outputs and workspace, made by torch's ops before and not counted); 2 more (8 at
# d = 2) before encode, segment and decode became one autograd node (flows/expert_node.py), whose segment
# takes its chunks' views by one unbind per buffer rather than one index per chunk.
CASES = {
    "f=1": ({}, {}, {"ops": 82, "calls": 10, "allocations": 14}),
    "f=1 d=2": ({}, {"a2a_ffn_overlap_degree": 2}, {"ops": 119, "calls": 12, "allocations": 18}),
    "f=1 prioritized": ({"batch_prioritized_routing": True}, {}, {"ops": 86, "calls": 10, "allocations": 14}),
    # f=0 counts each expert's choices by a scatter (2 ops more than bincount, whose output size is a read).
    "f=0": ({"capacity_factor": 0.0}, {}, {"ops": 88, "calls": 10, "allocations": 14}),
    "f=0 worst_case": ({"capacity_factor": 0.0, "dropless_capacity": "worst_case"}, {},
                       {"ops": 82, "calls": 10, "allocations": 14}),
    # The dropless flow on one rank: permute, the grouped GEMMs, unpermute. Before the grouped GEMMs and the
    # one-rank flow without exchanges: 150 ops, 34 calls, 2 waits and 22 allocations (86 ops before its counts
    # came from the host).
    # Its one read is a2a.permute's wait for the counts (dropless must size its rows).
    "dropless": ({"capacity_factor": 0.0, "flow": "dropless"}, {},
                 {"ops": 64, "calls": 10, "allocations": 16, "host_waits": 1, "reads": 0}),
    # Without that wait (one rank: a2a.permute(..., wait=False), the grouped GEMMs by offsets on the device):
    # 5 ops more (the offsets copied and cast, their differences, the empty experts' gradients zeroed).
    "dropless wait=False": ({"capacity_factor": 0.0, "flow": Dropless(wait=False)}, {},
                            {"ops": 69, "calls": 10, "allocations": 16, "reads": 0}),
}


def step_cost(layer, x, call):
    ops = DispatchedOps()
    with counting_alone() as cost, ops:
        y = layer(x, **call)
        (y.sum() + y.l_aux).backward()
    return ops.ops, cost.counters


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_stays_within_its_budget(comm, name):
    options, call, budget = CASES[name]
    options = dict(options)
    gate = {"type": "top", "k": 2, "capacity_factor": options.pop("capacity_factor", 1.0)}
    experts = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": H}
    layer = moe_runtime.MoELayer(gate, M, experts, comm=comm, seeds=(1, 2), **options)
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(3), requires_grad=True)
    for _ in range(3):  # buffers, scratch and the dictionary's first choices are made once
        step_cost(layer, x, call)
    costs = [step_cost(layer, x, call) for _ in range(2)]
    assert costs[0] == costs[1], f"{name}: a step costs differently from the one before: {costs}"
    ops, counters = costs[-1]
    reads = sum(n for op, n in ops.items() if op in SIZED_BY_VALUES)  # item(), bincount, nonzero ...
    measured = {"ops": sum(ops.values()), "calls": counters.calls, "allocations": counters.allocations}
    assert counters.host_waits == budget.get("host_waits", 0), f"{name}: {counters}"
    counted = gate["capacity_factor"] <= 0 and options.get("dropless_capacity") != "worst_case"
    expected_reads = budget.get("reads", 1 if counted else 0)
    assert reads == expected_reads, f"{name}: {reads} tensor values read on the host"
    over = {key: (measured[key], budget[key]) for key in measured if measured[key] > budget[key]}
    assert not over, f"{name}: over budget (measured, budget): {over}; all ops: {dict(ops)}"
