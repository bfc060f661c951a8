"""The per-expert capacity policy (moe_runtime.dynamic.capacity) on given
demands: the first call, growth at once, shrinking only after a lasting fall
below the band, the granularity, the bound and the count of changes; and
bad settings."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
from moe_runtime import CapacityTracker, DynamicCapacity


def tracker(num_experts=3, **settings):
    return CapacityTracker(DynamicCapacity(**settings), num_experts)


def test_first_call_is_margin_times_demand_rounded_up():
    t = tracker(margin=1.25, granularity=4)
    assert t.update(np.array([10, 0, 3]), 13, 1).tolist() == [16, 0, 4]  # 12.5 -> 16, 0, 3.75 -> 4
    assert t.changes == 1 and t.average.tolist() == [10, 0, 3]


def test_an_overflowing_expert_grows_in_the_same_call():
    t = tracker(margin=1.0, granularity=1, momentum=0.5)
    t.update(np.array([4, 4, 4]), 12, 1)
    got = t.update(np.array([9, 4, 1]), 14, 1)
    assert got.tolist() == [9, 4, 4]  # expert 0 grows to its demand now; the others keep theirs
    assert t.changes == 2


def test_growth_keeps_the_margin():
    t = tracker(margin=1.5, granularity=1, momentum=0.9)
    t.update(np.array([10, 0, 0]), 10, 1)  # 15
    assert t.update(np.array([21, 0, 0]), 21, 1).tolist()[0] == 32  # ceil(1.5 * 21)


def test_shrinking_waits_for_patience_calls_below_the_band():
    t = tracker(margin=1.0, granularity=1, momentum=0.0, shrink_band=0.5, shrink_patience=3)
    t.update(np.array([100, 10, 10]), 100, 1)
    seen = [t.update(np.array([40, 10, 10]), 100, 1).tolist()[0] for _ in range(4)]
    assert seen == [100, 100, 40, 40]  # below half for 3 calls in a row, then down to the target
    assert t.changes == 2


def test_a_call_back_above_the_band_restarts_the_wait():
    t = tracker(margin=1.0, granularity=1, momentum=0.0, shrink_band=0.5, shrink_patience=2)
    t.update(np.array([100, 1, 1]), 100, 1)
    demands = [40, 60, 40, 40]  # 60 is above the band: the count starts again
    assert [t.update(np.array([d, 1, 1]), 100, 1).tolist()[0] for d in demands] == [100, 100, 100, 40]


def test_small_falls_never_shrink():
    t = tracker(margin=1.0, granularity=1, momentum=0.0, shrink_band=0.5, shrink_patience=1)
    t.update(np.array([100, 1, 1]), 100, 1)
    for _ in range(10):
        assert t.update(np.array([60, 1, 1]), 100, 1).tolist()[0] == 100
    assert t.changes == 1


def test_the_bound_caps_every_expert():
    t = tracker(granularity=2, max_factor=0.5)
    got = t.update(np.array([30, 2, 0]), 20, 2)  # bound ceil(0.5 * 2 * 20 / 3) = 7 -> 8
    assert got.tolist() == [8, 4, 0]
    assert t.update(np.array([31, 2, 0]), 20, 2).tolist() == [8, 4, 0] and t.changes == 1


def test_capacities_are_copies_and_repr_shows_them():
    t = tracker()
    got = t.update(np.array([1, 2, 3]), 6, 1)
    got[0] = 99
    assert t.capacities[0] != 99
    assert "capacities=[8, 8, 8]" in repr(t)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"margin": 0.9}, "margin must be >= 1"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"shrink_band": 0.0}, r"shrink_band must be in \(0, 1\]"),
        ({"shrink_patience": 0}, "shrink_patience must be an integer >= 1"),
        ({"granularity": 2.0}, "granularity must be an integer >= 1"),
        ({"max_factor": -1.0}, "max_factor must be > 0 or None"),
        ({"margin": float("nan")}, "margin must be a finite number"),
        ({"momentum": "0.5"}, "momentum must be a finite number"),
    ],
)
def test_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        DynamicCapacity(**settings)


def test_bad_demand():
    with pytest.raises(ValueError, match=r"demand must be \(3,\) counts >= 0"):
        tracker().update(np.array([1, 2]), 3, 1)
    with pytest.raises(TypeError, match="must be a moe_runtime.DynamicCapacity"):
        CapacityTracker({"margin": 2.0}, 3)
