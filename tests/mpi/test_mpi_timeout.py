"""Timeouts: one rank skips a collective; the others must raise
A2ATimeoutError naming the missing peer instead of hanging, and the
communicator is retired afterwards (TransportError).

These tests leave messages in flight on dedicated communicators, so
tests/run_mpi.py runs them in their own mpirun (A2A_TEST_TIMEOUT=1); elsewhere
they are skipped. Each scenario runs once, in a module fixture that keeps every
rank in step (barriers on COMM_WORLD, no assertion in between) and records what
each phase returned or raised; the tests only inspect the records, so a failed
check never leaves a rank waiting for the others.

A scenario, with `missing` the rank that skips:
  1. every rank but `missing` calls the collective on a comm with a 1 s
     timeout (timeout_s= or A2A_TIMEOUT_S): they time out;
  2. `missing` calls it late. Its peers have given up: small messages they had
     already sent may still complete its exchange, large ones (rendezvous)
     cannot, so it times out naming the peers it could not send to;
  3. every rank calls the collectives again on that comm: the ranks that timed
     out refuse at once (TransportError), and the late rank ends up retired
     too;
  4. a fresh comm works.
The scenario's comm is made with A2A_DEBUG=WARN, and what the first call
writes to stderr is kept: every timeout is also a WARN line there.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

import numpy as np
import pytest
import reference as ref

import a2a

pytestmark = pytest.mark.skipif(
    os.environ.get("A2A_TEST_TIMEOUT") != "1", reason="run by tests/run_mpi.py in a dedicated mpirun"
)

# name -> (how the 1 s timeout is set, collective, elements per peer, which rank skips)
SCENARIOS = {
    "arg-all_to_all-small": ("arg", "all_to_all", 2, "first"),
    "env-all_to_all_v-small": ("env", "all_to_all_v", 3, "last"),
    "arg-all_to_all_flex-small": ("arg", "all_to_all_flex", 2, "first"),
    "arg-all_to_all-large": ("arg", "all_to_all", 2**18, "first"),  # 1 MiB of int32 per peer
    "env-all_to_all_flex-large": ("env", "all_to_all_flex", 2**18, "last"),
}
OPS = ("all_to_all", "all_to_all_v", "all_to_all_flex")


def attempt(call):
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001 (recorded; the tests inspect it)
        return None, error


def attempt_capturing_stderr(call):
    """(attempt(call), what was written to file descriptor 2 meanwhile, by
    native code too)."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            outcome = attempt(call)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return outcome, sink.read().decode(errors="replace")


def make_calls(comm, x, per_peer):
    w = comm.size
    return {
        "all_to_all": lambda: a2a.all_to_all(x, comm=comm),
        "all_to_all_v": lambda: a2a.all_to_all_v(x, [per_peer] * w, comm=comm)[0],
        "all_to_all_flex": lambda: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=0),
    }


def run_scenario(world, comm, missing, op, per_peer):
    w = comm.size
    shape = (w * per_peer,)
    # The inputs stay referenced by the record: sends that a timed-out rank
    # abandoned may still read them later.
    x = ref.a2a_input("timeout", comm.rank, w, shape, "int32")
    calls = make_calls(comm, x, per_peer)
    record = {"op": op, "missing": missing, "input": x, "per_peer": per_peer}
    record["expected"] = ref.a2a_expected("timeout", comm.rank, w, shape, "int32")
    world.Barrier()
    if comm.rank != missing:
        start = time.monotonic()
        record["first"], record["first_stderr"] = attempt_capturing_stderr(calls[op])
        record["first_seconds"] = time.monotonic() - start
    world.Barrier()
    if comm.rank == missing:
        record["late"] = attempt(calls[op])
    world.Barrier()
    record["again"] = [(name, *attempt(calls[name])) for name in OPS]
    world.Barrier()
    fresh = a2a.Comm.from_mpi(world)
    y = ref.a2a_input("fresh", fresh.rank, w, (w * 3,), "int64")
    record["fresh"] = attempt(lambda: a2a.all_to_all(y, comm=fresh))
    record["fresh_expected"] = ref.a2a_expected("fresh", fresh.rank, w, (w * 3,), "int64")
    world.Barrier()
    return record


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request, world):
    if world.Get_size() < 2:
        pytest.skip("needs at least 2 ranks")
    how, op, per_peer, which = SCENARIOS[request.param]
    missing = 0 if which == "first" else world.Get_size() - 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("A2A_DEBUG", "WARN")
        if how == "arg":
            comm = a2a.Comm.from_mpi(world, timeout_s=1)
        else:
            mp.setenv("A2A_TIMEOUT_S", "1")
            comm = a2a.Comm.from_mpi(world)
    return comm, run_scenario(world, comm, missing, op, per_peer)


def peer_named(message, peer):
    return re.search(rf"\brank {peer}\b(?! of)", message) is not None


def waiting(scenario):
    comm, record = scenario
    if comm.rank == record["missing"]:
        pytest.skip("this rank is the one that skipped the collective")
    result, error = record["first"]
    assert error is not None, f"rank {comm.rank}: the collective returned {result!r} without its peer"
    return comm, record, error


def late(scenario):
    comm, record = scenario
    if comm.rank != record["missing"]:
        pytest.skip("only the late rank")
    return comm, record


def test_waiting_ranks_raise_timeout(scenario):
    comm, _, error = waiting(scenario)
    assert isinstance(error, a2a.A2ATimeoutError), repr(error)
    assert isinstance(error, TimeoutError)
    message = str(error)
    assert f"rank {comm.rank} of {comm.size}" in message, message
    assert "timed out" in message and "A2A_TIMEOUT_S" in message, message


def test_timeout_is_a_warn_line_on_the_debug_channel(scenario):
    comm, record, error = waiting(scenario)
    warned = [line for line in record["first_stderr"].splitlines() if " WARN " in line]
    prefix = f"[a2a rank {comm.rank}] WARN rank {comm.rank} of {comm.size}: timed out"
    assert any(line.startswith(prefix) for line in warned), (
        f"no {prefix!r} line in {record['first_stderr']!r}"
    )
    assert str(error).endswith(warned[0][len(f"[a2a rank {comm.rank}] WARN ") :]), (warned, str(error))


def test_timeout_names_the_collective(scenario):
    _, record, error = waiting(scenario)
    assert record["op"] in str(error), f"the timeout does not say which collective waited: {error}"


def test_timeout_names_the_missing_peer(scenario):
    comm, record, error = waiting(scenario)
    message = str(error)
    assert peer_named(message, record["missing"]), (
        f"rank {comm.rank}: the timeout does not name the missing rank {record['missing']}: {message}"
    )
    assert "rank -1" not in message, f"a bogus peer is named: {message}"


def test_waiting_ranks_retire_the_comm(scenario):
    comm, record, _ = waiting(scenario)
    for name, result, error in record["again"]:
        assert isinstance(error, a2a.TransportError), f"{name} on the retired comm: {result!r} / {error!r}"
        message = str(error)
        assert name in message, message
        assert f"rank {comm.rank}" in message, message
        assert "unusable" in message and "create a new one" in message, message
        assert "timed out" in message, f"the original cause is not kept: {message}"


def test_late_rank_never_gets_wrong_data(scenario):
    """Whatever the late rank's call does, it must not hang (the fixture would)
    and must not return data other than the all-to-all result."""
    _, record = late(scenario)
    result, error = record["late"]
    if error is None:
        ref.assert_bitwise_equal(result, record["expected"], "late rank's result")
    else:
        assert isinstance(error, (a2a.A2ATimeoutError, a2a.TransportError)), repr(error)


def test_late_rank_times_out_on_unmatched_large_sends(scenario):
    comm, record = late(scenario)
    if record["per_peer"] < 2**16:
        pytest.skip("small messages may complete from what the peers sent before giving up")
    result, error = record["late"]
    assert isinstance(error, a2a.A2ATimeoutError), f"late call on large messages: {result!r} / {error!r}"
    message = str(error)
    assert record["op"] in message and f"rank {comm.rank} of {comm.size}" in message, message
    for peer in range(comm.size):
        if peer != comm.rank:
            assert f"send to rank {peer} " in message, f"the unmatched send to {peer} is not named: {message}"


def test_timeout_lists_only_unfinished_requests(scenario):
    """The late rank's exchange with itself completed (and so did its receives
    from the peers, which had sent before giving up): a timeout message that
    lists them as unfinished sends the reader after the wrong peers."""
    comm, record = late(scenario)
    if record["per_peer"] < 2**16:
        pytest.skip("needs the large-message scenario")
    _, error = record["late"]
    message = str(error)
    me = comm.rank
    assert f"recv from rank {me} " not in message and f"send to rank {me} " not in message, (
        f"rank {me}'s completed exchange with itself is listed as unfinished: {message}"
    )


def test_late_rank_ends_up_retired(scenario):
    _, record = late(scenario)
    for name, result, error in record["again"]:
        assert isinstance(error, (a2a.A2ATimeoutError, a2a.TransportError)), f"{name}: {result!r} / {error!r}"
    name, result, error = record["again"][-1]
    assert isinstance(error, a2a.TransportError), f"{name} after the timeouts: {result!r} / {error!r}"


def test_a_fresh_comm_works(scenario):
    _, record = scenario
    result, error = record["fresh"]
    assert error is None, repr(error)
    ref.assert_bitwise_equal(result, record["fresh_expected"])


def test_unused_input_is_intact(scenario):
    """Timed-out calls never write into their inputs."""
    comm, record = scenario
    x = record["input"]
    ref.assert_bitwise_equal(
        x, ref.a2a_input("timeout", comm.rank, comm.size, (comm.size * record["per_peer"],), "int32")
    )
    assert isinstance(x, np.ndarray)


@pytest.fixture(scope="module")
def late_creation(world):
    """Every rank but the last creates a communicator with a 1 s timeout; the
    last joins the duplication only after they gave up (with a bare Idup, so
    that the requests they left behind complete and COMM_WORLD stays in step)."""
    if world.Get_size() < 2:
        pytest.skip("needs at least 2 ranks")
    missing = world.Get_size() - 1
    record = {"missing": missing}
    world.Barrier()
    if world.Get_rank() != missing:
        start = time.monotonic()
        record["outcome"] = attempt(lambda: a2a.Comm.from_mpi(world, timeout_s=1))
        record["seconds"] = time.monotonic() - start
    else:
        time.sleep(3)
        dup, request = world.Idup()
        request.Wait()
        dup.Free()
    world.Barrier()
    return record


def test_creation_waiting_for_a_missing_rank_times_out(late_creation, world):
    if world.Get_rank() == late_creation["missing"]:
        pytest.skip("this rank is the one that came late")
    result, error = late_creation["outcome"]
    assert isinstance(error, a2a.A2ATimeoutError), f"creation without rank {late_creation['missing']}: {result!r}"
    message = str(error)
    for fragment in (f"rank {world.Get_rank()} of {world.Get_size()}", "communicator creation", "MPI_Comm_idup"):
        assert fragment in message, message
    assert late_creation["seconds"] < 2.5, late_creation["seconds"]


@pytest.fixture(scope="module")
def late_split(world):
    """Every rank but the last splits a communicator with a 1 s timeout; the
    last calls split only after they gave up; then every rank calls split
    again on that communicator."""
    if world.Get_size() < 2:
        pytest.skip("needs at least 2 ranks")
    missing = world.Get_size() - 1
    comm = a2a.Comm.from_mpi(world, timeout_s=1)
    record = {"missing": missing}
    world.Barrier()
    if comm.rank != missing:
        start = time.monotonic()
        record["outcome"] = attempt(lambda: comm.split(0))
        record["seconds"] = time.monotonic() - start
    world.Barrier()
    if comm.rank == missing:
        record["late"] = attempt(lambda: comm.split(0))
    world.Barrier()
    record["again"] = attempt(lambda: comm.split(0))
    world.Barrier()
    return record


def test_split_waiting_for_a_missing_rank_times_out(late_split, world):
    if world.Get_rank() == late_split["missing"]:
        pytest.skip("this rank is the one that came late")
    result, error = late_split["outcome"]
    assert isinstance(error, a2a.A2ATimeoutError), f"split without rank {late_split['missing']}: {result!r}"
    message = str(error)
    for fragment in ("split", f"rank {world.Get_rank()} of {world.Get_size()}", "timed out"):
        assert fragment in message, message
    assert late_split["seconds"] < 5, late_split["seconds"]


def test_a_late_split_fails_too(late_split, world):
    if world.Get_rank() != late_split["missing"]:
        pytest.skip("only the late rank")
    result, error = late_split["late"]
    assert isinstance(error, (a2a.A2ATimeoutError, a2a.TransportError)), f"late split: {result!r}"
    assert "split" in str(error), str(error)


def test_a_timed_out_split_retires_the_comm(late_split):
    result, error = late_split["again"]
    assert isinstance(error, a2a.TransportError), f"split on the retired comm: {result!r} / {error!r}"
    message = str(error)
    assert "split" in message and "unusable" in message, message
