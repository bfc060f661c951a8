"""Arguments of the wrong kind get an error that names the call and the
argument, not one from deep inside (found by fuzzing the public API)."""

from __future__ import annotations

import numpy as np
import pytest
from checks import raises_invalid

import a2a

torch = pytest.importorskip("torch")


def test_arguments_of_the_wrong_kind_are_named(comm):
    from mpi4py import MPI

    with pytest.raises(TypeError, match="counters: comm must be an a2a.Comm or None"):
        a2a.counters(5)
    with pytest.raises(TypeError, match="counting: comm must be an a2a.Comm or None"):
        a2a.counting("x")
    with pytest.raises(TypeError, match="route: wait must be True or False, got 'no'"):
        a2a.route(np.array([[0, 1]]), 2, capacity=1, wait="no")
    with pytest.raises(TypeError, match="LowLatencyBuffer: comm must be an a2a.Comm, got Intracomm"):
        a2a.LowLatencyBuffer(MPI.COMM_SELF, 4, 8, 2, 2, dtype="float32")
    index = a2a.es_index(np.array([[0]]), 1)
    raises_invalid(lambda: a2a.esmm(np.ones((1, 3), np.float32), np.ones((1, 2, 3), np.float32), index,
                                    x_rows=["token"]), "esmm: x_rows must be one of 'token', 'choice'; got ['token']")
    import a2a.torch as a2a_torch

    routing = a2a.route(torch.tensor([[0]]), 1, capacity=1)
    raises_invalid(lambda: a2a_torch.fast_encode(torch.ones(1, 4), routing, out=np.empty(4)), "fast_encode: out is a "
                   "numpy array")


def test_counts_are_integers_and_a_plans_counts_stay_its_own(comm):
    x = np.ones((1, 2), np.float32)
    raises_invalid(lambda: a2a.all_to_all_v(x, [True], comm=comm), "all_to_all_v", "send_counts must be 1 integers")
    plan = a2a.plan_v([1], like=x, comm=comm)
    for counts in (plan.send_counts, plan.recv_counts):
        with pytest.raises(ValueError, match="read-only"):
            counts[0] = 0
    assert np.array_equal(plan.run(x), x)
