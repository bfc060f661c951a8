"""Assertions on a2a's errors, shared by the test files (tests/reference.py
stays free of a2a; this module is its a2a-aware companion)."""

from __future__ import annotations

import contextlib
import gc

import pytest

import a2a


@contextlib.contextmanager
def counting_alone():
    """a2a.counting() over a window in which Python's cycle collector does not run: an earlier test's
    communicator, collected inside the window, would count its teardown (a call and a host wait). Cheaper
    than a gc.collect() before each window (75 ms with torch loaded, times the ranks sharing a core)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with a2a.counting() as cost:
            yield cost
    finally:
        if enabled:
            gc.enable()


def raises_invalid(call, *fragments):
    """call() raises InvalidArgumentError whose message holds every fragment;
    returns the message."""
    with pytest.raises(a2a.InvalidArgumentError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert info.value.status == a2a.InvalidArgumentError.status
    return message


def names_choice(message, token, choice):
    """The message points at the offending choice: indices[token, choice]."""
    return f"indices[{token}, {choice}]" in message


def predicted_comm(world, cross_check=True):
    """A communicator of the test factory's "predicted" arrangement over the
    mpi4py communicator `world` (setup/testing_comm.hpp: the data staged
    through host memory over MPI, the check of predicted calls posted, as on
    NCCL under MPI; docs/algorithms.md, "The predicted check")."""
    from mpi4py import MPI

    from a2a import _C

    native = _C.testing_comm_create_mpi("predicted", MPI._addressof(world), 0, 0.0, -1, 0, 0, -1, int(cross_check))
    return a2a.Comm(native, world)
