"""Budgets of what a call costs (a2a.counters, README "What calls cost: counters"), held
in steady state (the same call repeated): on MPI communicators the
cross-rank check travels in the algorithms' own messages, so it adds no
round and no message to linear, 2DH, flex (every path), all_to_all_v (one
round, and planned), all_gather and the reductions (a2a's own exchanges
there): a checked call costs exactly what the same call costs with
cross_check=False, or, for the reductions, no round beyond their own. Every
call on the staged and control-over-device communicators still pays one
round for the check, but on the predicted ones (A2A_TEST_STAGING=predicted, the
arrangement of MPI and NCCL; torchrun's gloo group): there, once the calls repeat, the check is
posted (W - 1 messages) and completed at the next call, with no round.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from a2a_mpi_util import regular
from launcher import TORCHRUN, job_comm

import a2a

STAGING = os.environ.get("A2A_TEST_STAGING", "")
# Every comm of this suite is from_mpi on the CPU, or torchrun's over gloo; staged ones check by round.
IN_BAND = not STAGING and not TORCHRUN
# ... or post the check of a predicted call: the arrangement of MPI and NCCL, and the gloo group
# (which cannot label messages: the check travels as messages of its own, beside the data).
PREDICTED = STAGING == "predicted" or TORCHRUN
ROUNDS = 3


@pytest.fixture(scope="module")
def unchecked(request):
    return job_comm(request, lambda world: a2a.Comm.from_mpi(world, cross_check=False), cross_check=False)


def x_for(comm, rows_per_peer, width=3, dtype=np.float32):
    return np.arange(comm.size * rows_per_peer * width, dtype=dtype).reshape(comm.size * rows_per_peer, width)


def steady_cost(comm, call):
    """What one call costs once it is warm (the mean of ROUNDS calls; the
    predicted check needs the same call twice to predict it, and a plan's
    first run is not yet like the next)."""
    for _ in range(3):
        call()
    with a2a.counting(comm) as cost:
        for _ in range(ROUNDS):
            call()
    total = cost.counters
    for name, value in total.as_dict().items():
        assert value % ROUNDS == 0, f"{name}: {value} over {ROUNDS} equal calls"
    return a2a.Counters(**{name: value // ROUNDS for name, value in total.as_dict().items()})


def two_dh_phases(comm):
    """(rounds, messages) of one 2DH call: intra-node, then along the rail."""
    if comm.num_nodes == 1 or comm.local_size == 1:
        return (1 if comm.size > 1 else 0), comm.size - 1
    return 2, (comm.local_size - 1) + (comm.num_nodes - 1)


def flex_call(comm, algo, layout):
    """Layouts that take each path of the flexible all-to-all (docs/algorithms.md)."""
    w = comm.size
    if layout == "contiguous":
        x = np.zeros((w * 4, 3), np.float32)
        return lambda c: a2a.all_to_all_flex(x, comm=c, split_axis=0, concat_axis=0, algo=algo)
    if layout == "strided":  # packed, or datatypes on linear
        x = np.zeros((3, w * 4), np.float32)
        return lambda c: a2a.all_to_all_flex(x, comm=c, split_axis=1, concat_axis=0, algo=algo)
    x = np.zeros((2, w, 2, 16 * 1024), np.float32)  # pieces of 128 KiB (linear)
    return lambda c: a2a.all_to_all_flex(x, comm=c, split_axis=1, concat_axis=0, algo=algo)


def v_call(comm, algo):
    counts = [(comm.rank + peer) % 3 + 1 for peer in range(comm.size)]
    x = np.ones((sum(counts), 2), np.float64)
    return lambda c: a2a.all_to_all_v(x, counts, comm=c, algo=algo)


def plan_call(comm, algo):
    x = np.ones((comm.size * 2, 2), np.float32)
    plans = {}

    def call(c):
        plan = plans.get(id(c)) or plans.setdefault(id(c), a2a.plan_v([2] * comm.size, like=x, comm=c, algo=algo))
        return plan.run(x)

    return call


CALLS = {
    "all_to_all": lambda comm, algo: (lambda c: a2a.all_to_all(x_for(comm, 2), comm=c, algo=algo)),
    "flex-contiguous": lambda comm, algo: flex_call(comm, algo, "contiguous"),
    "flex-strided": lambda comm, algo: flex_call(comm, algo, "strided"),
    "flex-pieces": lambda comm, algo: flex_call(comm, algo, "pieces"),
    "all_to_all_v": v_call,
    "plan_v.run": plan_call,
}


@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("name", list(CALLS))
def test_the_check_costs_nothing_in_steady_state(comm, unchecked, name, algo):
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    call = CALLS[name](comm, algo)
    checked_cost, unchecked_cost = steady_cost(comm, lambda: call(comm)), steady_cost(unchecked, lambda: call(unchecked))
    assert unchecked_cost.check_rounds == 0, unchecked_cost
    if PREDICTED and comm.size > 1:  # posted: W - 1 messages per collective, no round
        assert checked_cost.check_rounds == 0, checked_cost
        assert checked_cost.control_rounds == unchecked_cost.control_rounds, (checked_cost, unchecked_cost)
        extra = checked_cost.collectives * (comm.size - 1)
        assert checked_cost.control_messages == unchecked_cost.control_messages + extra, (checked_cost, unchecked_cost)
        return
    if not IN_BAND:  # a round per collective (a planned v is two: the plan's, then the run's)
        assert checked_cost.check_rounds == (checked_cost.collectives if comm.size > 1 else 0), checked_cost
        return
    assert checked_cost.check_rounds == 0, checked_cost
    for path in ("collectives", "data_rounds", "data_messages", "control_rounds", "control_messages"):
        assert getattr(checked_cost, path) == getattr(unchecked_cost, path), (path, checked_cost, unchecked_cost)
    assert checked_cost.host_waits == 0, checked_cost


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_all_to_all_rounds_and_messages(comm, algo):
    if algo == "2dh" and not regular(comm):
        pytest.skip("2dh needs nodes of equal size")
    cost = steady_cost(comm, lambda: a2a.all_to_all(x_for(comm, 2), comm=comm, algo=algo))
    rounds, messages = two_dh_phases(comm) if algo == "2dh" else ((1 if comm.size > 1 else 0), comm.size - 1)
    assert (cost.data_rounds, cost.data_messages) == (rounds, messages), cost
    assert cost.calls == 1 and cost.allocations == 0, cost
    if comm.size == 1:  # one rank copies its block on its device, whatever the transport: nothing waits
        assert (cost.control_rounds, cost.control_messages, cost.host_waits, cost.kernel_calls) == (0, 0, 0, 1), cost
    elif IN_BAND:
        assert (cost.control_rounds, cost.control_messages, cost.host_waits) == (0, 0, 0), cost
        # 2DH transposes twice where it has two phases; linear moves nothing on the device
        assert cost.kernel_calls == (2 if algo == "2dh" and rounds == 2 else 0), cost
    elif TORCHRUN:  # the check posted beside the exchange on the control lane (over gloo); nothing to wait for
        assert (cost.check_rounds, cost.control_rounds, cost.host_waits) == (0, 0, 0), cost
        assert cost.control_messages == comm.size - 1, cost
    else:  # the staging copies and the stream wait of a transport through host memory, or of the check's
        assert cost.host_waits >= 1 and cost.kernel_calls >= 2, cost


def test_all_gather_carries_the_check(comm, unchecked):
    x = np.ones(5, np.float32)
    checked_cost = steady_cost(comm, lambda: a2a.all_gather(x, comm=comm))
    unchecked_cost = steady_cost(unchecked, lambda: a2a.all_gather(x, comm=unchecked))
    assert checked_cost.check_rounds == (0 if IN_BAND or PREDICTED or comm.size == 1 else 1), checked_cost
    assert checked_cost.data_rounds == unchecked_cost.data_rounds, (checked_cost, unchecked_cost)


def test_all_gather_v_carries_the_check(comm):
    counts = [r % 2 + 1 for r in range(comm.size)]
    x = np.ones(counts[comm.rank], np.float32)
    cost = steady_cost(comm, lambda: a2a.all_gather_v(x, counts, comm=comm))
    if IN_BAND:
        assert (cost.check_rounds, cost.control_rounds) == (0, 0), cost
        assert cost.data_rounds == (1 if comm.size > 1 else 0), cost


@pytest.mark.parametrize(
    "name, call, rounds",
    [
        ("all_reduce", lambda x, c: a2a.all_reduce(x, comm=c), 2),  # reduce-scatter, then all-gather
        ("reduce_scatter", lambda x, c: a2a.reduce_scatter(x, comm=c), 1),
        ("reduce_scatter_v", lambda x, c: a2a.reduce_scatter_v(x, [7] * c.size, comm=c), 1),
    ],
)
def test_the_reductions_carry_the_check(comm, name, call, rounds):
    """In band the reductions are a2a's own exchanges, which carry the check;
    staged, the transport's reduction after a round of the check."""
    x = np.ones(7 * comm.size, np.float32)
    cost = steady_cost(comm, lambda: call(x, comm))
    if comm.size == 1 or PREDICTED:
        assert cost.check_rounds == 0, cost
    elif IN_BAND:
        assert (cost.check_rounds, cost.control_rounds, cost.data_rounds) == (0, 0, rounds), (name, cost)
        assert cost.data_messages == rounds * (comm.size - 1) and cost.allocations == 0, (name, cost)
    else:
        assert cost.check_rounds == 1, (name, cost)


@pytest.mark.parametrize("capacity", [{"capacity": 3}, {"capacity_setting": 0}, {"capacity": [3, 0, 2]}],
                         ids=["fixed", "fitted", "per-expert"])
def test_route_gathers_its_capacities_in_the_check(comm, capacity):
    """route(comm=) agrees on its capacities (each the maximum over the ranks)
    in one round that also carries the check."""
    indices = np.arange(8, dtype=np.int64).reshape(4, 2) % 3
    cost = steady_cost(comm, lambda: a2a.route(indices, num_experts=3, comm=comm, **capacity))
    if comm.size == 1:
        return
    if IN_BAND or PREDICTED:  # in band, or posted
        assert (cost.check_rounds, cost.control_rounds) == (0, 1), cost
    else:  # the check's round, then the capacities'
        assert (cost.check_rounds, cost.control_rounds) == (1, 2), cost


def test_a_mismatch_costs_the_settle_and_the_verdict(comm):
    if comm.size < 2 or not IN_BAND:
        pytest.skip("the in-band check between ranks")
    x = x_for(comm, 3 if comm.rank == 0 else 2)
    with a2a.counting(comm) as cost, pytest.raises(a2a.MismatchError):
        a2a.all_to_all(x, comm=comm)
    assert cost.counters.check_rounds == 2, cost.counters  # the settle, then the allgather of signatures


def test_the_process_totals_include_every_comm(comm, unchecked):
    x = x_for(comm, 1)
    with a2a.counting() as total, a2a.counting(comm) as one, a2a.counting(unchecked) as other:
        a2a.all_to_all(x, comm=comm)
        a2a.all_to_all(x, comm=unchecked)
    assert total.counters.data_rounds == one.counters.data_rounds + other.counters.data_rounds
    assert total.counters.collectives == 2
    assert total.counters.allocations >= 2  # the two outputs


def test_counting_needs_a_with_block():
    with pytest.raises(RuntimeError, match="inside or after"):
        _ = a2a.counting().counters
