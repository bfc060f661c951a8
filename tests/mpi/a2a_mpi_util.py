"""Helpers for tests/mpi.

The rule that keeps ranks in step: a test runs all of its collectives, on
every rank, before it asserts anything. A failed assertion ends the test on
that rank only; if a collective came after it, the other ranks would wait for
this one. So errors are captured with `outcome`, checks that must sit between
collectives are collected with `Deferred`, and everything is asserted at the
end.
"""

from __future__ import annotations

from typing import Any

import pytest

import a2a


def outcome(call) -> tuple[Any, a2a.A2AError | None]:
    """(result, None) or (None, the a2a error it raised). Other exceptions are
    test bugs and propagate."""
    try:
        return call(), None
    except a2a.A2AError as error:
        return None, error


class Deferred:
    """Collects failed checks; `done()` raises them all at once."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def run(self, check, *args, **kwargs) -> None:
        try:
            check(*args, **kwargs)
        except (AssertionError, pytest.fail.Exception) as failure:
            self.failures.append(str(failure))

    def done(self) -> None:
        if self.failures:
            raise AssertionError("\n\n".join(self.failures))


def regular(comm: a2a.Comm) -> bool:
    """Whether 2DH can run: nodes are equal blocks of consecutive ranks
    (emulated by A2A_LOCAL_SIZE, or detected: a real cluster's sub-communicator
    across nodes of different sizes is not, whatever each rank's local_size)."""
    return comm.irregular_reason == ""


def check_2dh_rejected(error: BaseException | None) -> None:
    """On an irregular topology algo='2dh' fails on every rank with the reason."""
    assert isinstance(error, a2a.InvalidArgumentError), f"expected InvalidArgumentError, got {error!r}"
    message = str(error)
    assert "algo=2dh needs nodes of equal size" in message, message
    assert "not divisible by local_size" in message or "not equal blocks of consecutive ranks" in message, message


def expect_2dh_rejected(call) -> None:
    check_2dh_rejected(outcome(call)[1])


def run_or_expect_rejection(comm: a2a.Comm, algo: str, call) -> Any:
    """Runs call(); with 2dh on an irregular topology, checks the rejection
    instead and returns None. (Every rank has the same topology, so every rank
    takes the same branch.)"""
    if algo == "2dh" and not regular(comm):
        expect_2dh_rejected(call)
        return None
    return call()


def check_bad_rank(comm: a2a.Comm, bad: int, op: str, error: BaseException | None, *fragments: str) -> str:
    """Rank `bad` passed invalid input: it raised InvalidArgumentError whose
    message holds `fragments`; every other rank raised RemoteError naming it."""
    if comm.rank == bad:
        assert isinstance(error, a2a.InvalidArgumentError), f"rank {bad}: expected InvalidArgumentError, got {error!r}"
        message = str(error)
        for fragment in (op, f"rank {bad} of {comm.size}", *fragments):
            assert fragment in message, f"{fragment!r} not in {message!r}"
    else:
        assert isinstance(error, a2a.RemoteError), f"rank {comm.rank}: expected RemoteError, got {error!r}"
        message = str(error)
        for fragment in (op, f"rank {comm.rank}", f"rank(s) {bad} rejected"):
            assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def expect_bad_rank(comm: a2a.Comm, bad: int, op: str, call, *fragments: str) -> str:
    return check_bad_rank(comm, bad, op, outcome(call)[1], *fragments)


def check_mismatch(error: BaseException | None, *fragments: str) -> str:
    """Every rank raised MismatchError whose message holds `fragments`."""
    assert isinstance(error, a2a.MismatchError), f"expected MismatchError, got {error!r}"
    message = str(error)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert error.status == a2a.MismatchError.status
    return message


def expect_mismatch(call, *fragments: str) -> str:
    return check_mismatch(outcome(call)[1], *fragments)
