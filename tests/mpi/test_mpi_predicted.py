"""The predicted check (docs/algorithms.md, "The predicted check"): on a
communicator whose data goes over a transport that returns before the data
moved (NCCL under MPI), a call that every rank predicted from the calls they
agreed on posts its check and goes on, and the check completes at the next
call. Run here under mpirun on the test arrangement of that communicator with
host memory (A2A_TEST_STAGING=predicted's factory: data staged over MPI, the
check of predicted calls posted), and under torchrun on the gloo group's
communicator (Comm.from_torch on the CPU: the check as messages of its own
on the control lane, as beside NCCL from a unique id), made by each test,
since a disagreement in a predicted call retires it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome, regular
from checks import predicted_comm
from launcher import TORCHRUN, job_comm

import a2a

RETIRED = "this communicator is retired on every rank"


def make_comm(request, cross_check=True):
    """A communicator that predicts: the gloo group's under torchrun, else the test arrangement over MPI."""
    return job_comm(request, lambda world: predicted_comm(world, cross_check), cross_check=cross_check)


@pytest.fixture
def comm(request):
    made = make_comm(request)
    if made.size < 2:
        pytest.skip("a check between ranks")
    return made


def algos(comm):
    return ("linear", "2dh") if regular(comm) else ("linear",)


def all_to_all(comm, rows_per_peer, algo, tag="predicted"):
    shape = (comm.size * rows_per_peer, 3)
    x = ref.a2a_input(tag, comm.rank, comm.size, shape, "float32")
    expected = ref.a2a_expected(tag, comm.rank, comm.size, shape, "float32")
    return lambda: a2a.all_to_all(x, comm=comm, algo=algo), expected


def steady(comm, call, expected, calls=3):
    """The same call until it is predicted: the last `calls` of them post
    their check (no round; W - 1 control messages each) and are exact."""
    for _ in range(2):
        ref.assert_bitwise_equal(call(), expected, "warming up")
    with a2a.counting(comm) as cost:
        for _ in range(calls):
            ref.assert_bitwise_equal(call(), expected, "a predicted call")
    c = cost.counters
    assert (c.check_rounds, c.control_rounds, c.control_messages) == (0, 0, calls * (comm.size - 1)), c


@pytest.mark.skipif(not TORCHRUN, reason="the gloo group's communicator")
def test_the_gloo_groups_communicator_predicts(request):
    size = make_comm(request).size
    assert make_comm(request).predicts_check == (size > 1)
    assert not make_comm(request, cross_check=False).predicts_check


@pytest.mark.skipif(not TORCHRUN, reason="torch.distributed's groups")
def test_nccl_from_torch_takes_a_gloo_group_of_its_ranks_for_its_check():
    """from_torch(device="cuda")'s control lane (a2a/_comm.py, _control_group):
    the group itself where it has gloo, else the one given, of the same ranks."""
    import torch.distributed as dist

    from a2a._comm import _control_group

    world = dist.group.WORLD
    assert _control_group(world, None) is world  # the suite's world group is gloo
    same = dist.new_group(backend="gloo")
    assert _control_group(world, same) is same
    assert _control_group(same, None) is same


@pytest.mark.skipif(not TORCHRUN, reason="torch.distributed's groups")
def test_the_host_twin_of_nccl_beside_a_gloo_group_is_a_host_communicator_over_that_group(request):
    """The layer's per-call agreement crosses the gloo group, not the GPU
    (a2a.Comm.host_twin). A CPU communicator dressed as from_torch's CUDA one
    stands in for it here: no GPU."""
    import torch.distributed as dist

    comm = make_comm(request)
    assert comm.host_twin() is comm  # a host communicator is its own twin
    comm.device, comm.control_group = "cuda", dist.group.WORLD
    twin = comm.host_twin()
    assert twin is not comm and twin.device == "cpu" and twin.transport == "external", twin
    assert (twin.rank, twin.size, twin.local_size) == (comm.rank, comm.size, comm.local_size)
    gathered = a2a.all_gather(np.full(2, comm.rank, np.int64), comm=twin)
    assert gathered.tolist() == [r for r in range(comm.size) for _ in range(2)], gathered


def test_the_host_twin_waits_as_long_as_its_communicator(request):
    """host_twin() makes a new communicator where the host values need one (MPI beneath a CUDA
    one: here the test arrangement that predicts; the gloo group beside NCCL: here under
    torchrun, a CPU communicator dressed as one); it takes the communicator's timeout_s."""
    comm = make_comm(request)
    if comm.size < 2:
        pytest.skip("a communicator of one rank does not predict: its own twin")
    if TORCHRUN:
        import torch.distributed as dist

        comm.device, comm.control_group = "cuda", dist.group.WORLD
    comm.timeout_s = 11.5
    twin = comm.host_twin()
    assert twin is not comm and twin.timeout_s == 11.5
    assert a2a.all_gather(np.full(1, comm.rank, np.int64), comm=twin).tolist() == list(range(comm.size))


@pytest.mark.skipif(not TORCHRUN, reason="the gloo group's communicator")
def test_the_round_arrangement_of_the_cost_tool_checks_every_call_by_round(request):
    """tools/torchrun_check_cost.py's "round" (a2a_testing_comm_create_external_by_round)."""
    import torch.distributed as dist

    from a2a import _C
    from a2a._torch_transport import TorchGroupTransport, agree_tag_base

    group = dist.group.WORLD
    transport = TorchGroupTransport(group, agree_tag_base(group))
    comm = a2a.Comm(_C.testing_comm_create_external_by_round(transport, "gloo", dist.get_world_size(),
                                                             dist.get_rank(), 0, 0.0, 1))
    assert not comm.predicts_check
    call, expected = all_to_all(comm, 2, "linear")
    with a2a.counting(comm) as cost:
        for _ in range(5):
            ref.assert_bitwise_equal(call(), expected, "checked by round")
    assert cost.counters.check_rounds == (5 if comm.size > 1 else 0), cost.counters


def test_only_the_arrangement_of_mpi_and_nccl_predicts(world):
    assert predicted_comm(world).predicts_check == (world.Get_size() > 1)
    assert not predicted_comm(world, cross_check=False).predicts_check
    # MPI alone carries the check in its messages, and the staged arrangements check by round; from_mpi
    # makes the predicted one itself in the predicted-* configurations (tests/mpi/conftest.py).
    predicted_everywhere = os.environ.get("A2A_TEST_STAGING", "") == "predicted"
    assert a2a.Comm.from_mpi(world).predicts_check == (predicted_everywhere and world.Get_size() > 1)


@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_a_repeated_call_posts_its_check(comm, algo):
    if algo not in algos(comm):
        pytest.skip("2dh needs nodes of equal size")
    call, expected = all_to_all(comm, 2, algo)
    steady(comm, call, expected)
    comm.check()  # completes the last one; nothing is posted after
    comm.check()


def test_calls_that_repeat_with_a_period_are_predicted(comm):
    """A step of several calls, repeated: predicted from its second repetition."""
    a, a_expected = all_to_all(comm, 2, "linear", "period-a")
    b, b_expected = all_to_all(comm, 5, "linear", "period-b")
    x = np.arange(4, dtype=np.float64) + comm.rank
    gathered = np.concatenate([np.arange(4, dtype=np.float64) + r for r in range(comm.size)])
    step = [(a, a_expected), (b, b_expected), (lambda: a2a.all_gather(x, comm=comm), gathered)]
    for _ in range(2):
        for call, expected in step:
            ref.assert_bitwise_equal(call(), expected, "warming up")
    with a2a.counting(comm) as cost:
        for _ in range(2):
            for call, expected in step:
                ref.assert_bitwise_equal(call(), expected, "a predicted step")
    assert cost.counters.check_rounds == 0, cost.counters


def test_every_rank_changing_alike_agrees_by_round(comm):
    call, expected = all_to_all(comm, 2, "linear")
    steady(comm, call, expected)
    other, other_expected = all_to_all(comm, 4, "linear", "changed")
    with a2a.counting(comm) as cost:
        ref.assert_bitwise_equal(other(), other_expected, "the changed call")
    assert cost.counters.check_rounds == 1, cost.counters  # not predicted: a round, which agrees
    steady(comm, other, other_expected)


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
def test_a_rank_leaving_the_predicted_call_raises_on_every_rank(comm, algo, which):
    """Its round finds the others' posted labels; they find its own while
    they wait for its data. Every rank raises, and the comm is retired: the
    data of the others was enqueued (on NCCL it waits for the rank that left)."""
    if algo not in algos(comm):
        pytest.skip("2dh needs nodes of equal size")
    odd = 0 if which == "first" else comm.size - 1
    call, expected = all_to_all(comm, 2, algo)
    steady(comm, call, expected)
    leaving, _ = all_to_all(comm, 3 if comm.rank == odd else 2, algo)
    check_mismatch(outcome(leaving)[1], "all_to_all", "'count per peer' differs", f"rank {odd}: 9", RETIRED)
    error = outcome(call)[1]
    assert isinstance(error, a2a.TransportError) and "unusable after an earlier failure" in str(error), error


def test_a_rank_leaving_a_predicted_reduction_raises_on_every_rank(comm):
    """The staged reduction is MPI's own collective, whose wait cannot watch
    the posted check: the check completes before it, so that no rank enters
    the collective that a peer left (nor meets the settle's collective there)."""
    odd = comm.size - 1
    x = np.arange(6 * comm.size, dtype=np.float64)
    expected = x * comm.size
    for _ in range(5):
        ref.assert_bitwise_equal(a2a.all_reduce(x, comm=comm), expected, "a predicted all_reduce")
    leaving = x[: 5 * comm.size] if comm.rank == odd else x
    check_mismatch(outcome(lambda: a2a.all_reduce(leaving, comm=comm))[1], "all_reduce", "'count' differs", RETIRED)


def test_bad_input_in_a_predicted_call_raises_on_every_rank(comm):
    bad = comm.size - 1
    call, expected = all_to_all(comm, 2, "linear")
    steady(comm, call, expected)
    x = np.zeros((comm.size * 2 + (1 if comm.rank == bad else 0), 3), np.float32)  # not divisible by the size
    message = check_bad_rank(comm, bad, "all_to_all", outcome(lambda: a2a.all_to_all(x, comm=comm))[1])
    assert RETIRED in message, message


def test_bad_input_in_a_predicted_2dh_plan_whose_first_phase_is_empty_on_one_node(request):
    """Every rank that posted stops at the same exchange of the call: here
    node 0 has nothing to exchange inside itself in the first 2DH phase of an
    all-to-all-v, node 1 has, and the last rank rejects its input. Found in
    review over gloo: node 0 stopped at the second phase and waited there for
    messages that node 1, stopped at the first, never posted (a timeout on
    every rank instead of the verdict). Bounded by a short timeout."""
    comm = make_comm(request) if not TORCHRUN else a2a.Comm.from_torch(device="cpu", timeout_s=20)
    if comm.size < 4 or comm.num_nodes < 2 or comm.local_size < 2 or not regular(comm):
        pytest.skip("2dh with two phases")
    # Node 0's ranks send nothing to the ranks of another local rank: its first phase moves nothing.
    counts = [2 if comm.node > 0 or r % comm.local_size == comm.local_rank else 0 for r in range(comm.size)]
    x = np.ones((sum(counts), 3), np.float32)
    plan = a2a.plan_v(counts, like=x, comm=comm, algo="2dh")
    for _ in range(4):
        plan.run(x)
    bad = comm.size - 1
    y = x[1:] if comm.rank == bad else x
    message = check_bad_rank(comm, bad, "all_to_all_v", outcome(lambda: plan.run(y))[1])
    if comm.rank != bad:
        assert RETIRED in message, message


@pytest.mark.parametrize("how", ["next call", "check"])
def test_a_disagreement_is_found_at_the_next_call(comm, how):
    """A predicted call that moves no data returns before any peer: the rank
    that left it raises in it, the others at their next call on the comm, or
    at comm.check(). Over gloo (torchrun) they raise in the call: its data
    lane completes the check at the call's first exchange."""
    odd = comm.size - 1
    call, expected = all_to_all(comm, 0, "linear")
    steady(comm, call, expected)
    leaving, _ = all_to_all(comm, 1 if comm.rank == odd else 0, "linear")
    error = outcome(leaving)[1]
    if comm.rank == odd:
        check_mismatch(error, "'count per peer' differs", RETIRED)
        return
    if TORCHRUN:  # over gloo the data lane completes the check at the call's first exchange, empty or not
        check_mismatch(error, "'count per peer' differs", "while this call waited for its peers", RETIRED)
        return
    assert error is None, error
    later = outcome(call if how == "next call" else comm.check)[1]
    found = "at the next call on this communicator, " + ("all_to_all" if how == "next call" else "check")
    check_mismatch(later, "all_to_all on rank", "'count per peer' differs", found, RETIRED)


def test_a_disagreement_of_calls_nobody_predicted_leaves_the_comm_usable(comm):
    """Where every rank checked by round, nothing was enqueued: as without prediction."""
    odd = comm.size - 1
    leaving, _ = all_to_all(comm, 3 if comm.rank == odd else 2, "linear")
    message = check_mismatch(outcome(leaving)[1], "'count per peer' differs")
    assert RETIRED not in message, message
    call, expected = all_to_all(comm, 2, "linear")
    steady(comm, call, expected)


def test_a_comm_freed_with_its_check_posted_spoils_no_later_one(request):
    """The last call's posted check is completed when the comm goes: Open MPI
    reuses a freed context, where a late message of the old comm was taken
    for a message of the next (found with one-shot all_to_all_v)."""
    size = make_comm(request).size
    if size < 2:
        pytest.skip("a check between ranks")
    counts = ref.v_counts("zero_to_next", size)
    for attempt in range(4):
        comm = make_comm(request)
        rank = comm.rank
        for step in range(4):
            tag = f"freed-{attempt}-{step}"
            x = ref.v_input(tag, rank, counts, (3,), "float32")
            expected, _ = ref.v_expected(tag, rank, counts, (3,), "float32")
            y, _ = a2a.all_to_all_v(x, counts[rank], comm=comm)
            ref.assert_bitwise_equal(y, expected, f"comm {attempt}, call {step}")
        del comm
