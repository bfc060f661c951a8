"""moe_runtime.flex.cost: Equation 5's parts against hand-computed values, the
adjustment cost, the non-negative line fit, the calibration recovering known
parameters from synthetic measurements (tests/flex_samples.py), with and
without a2a.sim's shape, its determinism, and the errors of bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flex_samples import (
    DEMAND,
    HAND,
    MS,
    TRUTH,
    TWO_RANKS,
    four_rank_samples,
    fresh_model,
    hand_model,
    measured_sample,
)

from moe_runtime.flex.cost import (
    Breakdown,
    Calibration,
    CostModel,
    Line,
    StepSample,
    busiest_bytes,
    fit_line,
    ring_factor,
)
from moe_runtime.flex.vexperts import Expand, Migrate, Shrink, SlotTable


def test_predict_two_ranks_four_experts_by_hand():
    # Routing (Algorithm 3): expert 0 (120 choices, one slot on rank 0): rank 0 keeps 60, rank 1 sends 60;
    # experts 1, 2 (10 each, a slot on each rank): targets 5 / 5, all kept; expert 3 (20, rank 1): rank 0
    # sends 10. Rows: rank 0 = 120 + 5 + 5 = 130, rank 1 = 5 + 5 + 20 = 30.
    # T_C = 1 ms x 130 = 0.130 s.
    # Dispatch bytes off the diagonal: 0 -> 1: 10, 1 -> 0: 60; busiest rank: max(10, 60) = 60 either way,
    # B^T the same: T_A2A = 2 x (60 + 60) x 1 ms = 0.240 s.
    # Replica groups: expert 1 (ranks 0, 1), expert 2 (ranks 0, 1): r(2) = 1, 10 bytes each, 1 ms/byte:
    # T_Sync = 2 x 0.010 = 0.020 s. Total 0.390 s.
    predicted = hand_model().predict(TWO_RANKS, DEMAND)
    expected = Breakdown(0.130, 0.240, 0.020, 0.0, 0.390)
    for name in ("compute_s", "a2a_s", "sync_s", "other_s", "total_s"):
        assert getattr(predicted, name) == pytest.approx(getattr(expected, name), rel=1e-12), name


def test_predict_after_expanding_the_hot_expert_by_hand():
    # Expert 0 in slot 4 (rank 1) instead of expert 1: expert 0 has a slot on each rank, targets 60 / 60,
    # all kept; expert 1 only on rank 0: rank 1 sends its 5; expert 2 kept; expert 3: rank 0 sends 10.
    # Rows: rank 0 = 60 + 10 + 5 = 75, rank 1 = 60 + 5 + 20 = 85 -> T_C = 0.085.
    # Off-rank bytes: 0 -> 1: 10, 1 -> 0: 5 -> busiest 10, T_A2A = 2 x (10 + 10) ms = 0.040.
    # Groups: expert 0 and expert 2 on (0, 1): T_Sync = 0.020. Total 0.145. other_s 0.5 adds on.
    table = SlotTable([[0, 1, 2], [3, 0, 2]], 4)
    predicted = hand_model(calibration=dataclasses.replace(HAND, other_s=0.5)).predict(table, DEMAND)
    assert (predicted.compute_s, predicted.a2a_s, predicted.sync_s) == pytest.approx((0.085, 0.040, 0.020))
    assert predicted.other_s == 0.5
    assert predicted.total_s == pytest.approx(0.645)


def test_compute_intercept_and_sync_latency_by_hand():
    # T_C = 0.002 + 130 x 1 ms = 0.132; each exchange 0.001 + shape: T_A2A = 2 x (0.061 + 0.061) = 0.244;
    # each all-reduce 0.003 + 10 bytes x 1 ms: T_Sync = 2 x 0.013 = 0.026.
    calibration = Calibration(Line(0.002, MS), Line(0.001, MS), Line(0.003, MS), 0.0)
    predicted = hand_model(calibration=calibration).predict(TWO_RANKS, DEMAND)
    assert (predicted.compute_s, predicted.a2a_s, predicted.sync_s) == pytest.approx((0.132, 0.244, 0.026))


def test_sync_counts_ring_factor_of_larger_groups():
    # Expert 0 on all 3 ranks: r(3) = 2 x 2 / 3 = 4/3 of 30 bytes = 40 bytes x 1 ms = 0.040 s.
    table = SlotTable([[0, 1], [0, 2], [0, 3]], 4)
    demand = np.zeros((3, 4), dtype=np.int64)
    assert ring_factor(3) == pytest.approx(4 / 3)
    assert hand_model(grad_bytes=30).predict(table, demand).sync_s == pytest.approx(0.040)


def test_adjustment_seconds_by_hand():
    model = hand_model(state_bytes=100)
    # Expand expert 0 into slot 4 (rank 1): its states come from slot 0 on rank 0, one message of 100 bytes:
    # one exchange, busiest rank 100 bytes x 1 ms = 0.1 s.
    _, remote = TWO_RANKS.apply([Shrink(4), Expand(0, 4)])
    assert model.adjustment_seconds(TWO_RANKS, remote) == pytest.approx(0.1)
    # Expand expert 0 into slot 1 (rank 0): copied from slot 0 on the same rank, no message.
    _, local = TWO_RANKS.apply([Shrink(1), Expand(0, 1)])
    assert model.adjustment_seconds(TWO_RANKS, local) == 0.0
    # Migrate 0 <-> 3: one message each way at once, each rank sends and receives 100 bytes: 0.1 s.
    _, swap = TWO_RANKS.apply([Migrate(0, 3)])
    assert model.adjustment_seconds(TWO_RANKS, swap) == pytest.approx(0.1)


def test_busiest_bytes_ignores_messages_to_oneself():
    # Rank 0 sends 3 + 4 = 7 off-rank, receives 1 + 5 = 6; rank 1 sends 1 + 2 = 3, receives 3 + 6 = 9;
    # rank 2 sends 5 + 6 = 11, receives 4 + 2 = 6. Busiest: 11.
    assert busiest_bytes(np.array([[100, 3, 4], [1, 100, 2], [5, 6, 100]])) == 11.0


def test_fit_line_recovers_a_line_and_keeps_both_terms_non_negative():
    x = np.array([1.0, 2.0, 4.0])
    assert fit_line(x, 0.5 + 2.0 * x) == Line(pytest.approx(0.5), pytest.approx(2.0))
    # Free fit y = -1 + 2x has a negative intercept; through the origin: b = sum xy / sum xx = 35 / 21.
    assert fit_line(x, np.array([1.0, 3.0, 7.0])) == Line(0.0, pytest.approx(35 / 21))
    # Falling data: the slope would be negative; the flat line at the mean is the best feasible one.
    assert fit_line(x, np.array([3.0, 2.0, 1.0])) == Line(pytest.approx(2.0), 0.0)
    # x does not vary: through the origin (Equation 7's form).
    assert fit_line(np.array([2.0, 2.0]), np.array([1.0, 1.0])) == Line(0.0, pytest.approx(0.5))


def assert_recovers(calibration, truth, rel):
    for part in ("compute", "exchange", "sync"):
        got, want = getattr(calibration, part), getattr(truth, part)
        assert got.slope == pytest.approx(want.slope, rel=rel), part
        assert got.intercept == pytest.approx(want.intercept, rel=rel), part
    assert calibration.other_s == pytest.approx(truth.other_s, rel=rel)


def test_fit_recovers_known_parameters():
    samples = four_rank_samples()
    model = fresh_model()
    assert not model.fitted
    calibration = model.fit(samples)
    assert model.fitted and calibration.samples == 8 and calibration.ranks == 4
    assert_recovers(calibration, TRUTH, rel=1e-6)
    assert np.abs(model.error(samples)).max() < 1e-9
    assert model.parameters()["tps"] == pytest.approx(1 / 3e-6)


def test_fit_recovers_the_scale_of_a2a_sim_shape():
    from a2a import sim

    topology = sim.preset("local", ranks=4, local_size=2)
    truth = dataclasses.replace(TRUTH, exchange=Line(5e-5, 1.7))  # this machine: 1.7x the preset's times
    model = fresh_model(topology)
    assert_recovers(model.fit(four_rank_samples(truth, topology)), truth, rel=1e-6)


def test_fit_with_noisy_measurements_predicts_within_a_few_percent():
    samples = four_rank_samples(noise=0.02, count=12)
    model = fresh_model()
    model.fit(samples[:8])
    assert np.abs(model.error(samples[8:])).mean() < 0.05


def test_fit_is_deterministic():
    samples = four_rank_samples(noise=0.05)
    first, second = fresh_model(), fresh_model()
    assert first.fit(samples) == second.fit(list(samples))
    assert first.predict(samples[0].table, samples[0].demand) == second.predict(samples[0].table, samples[0].demand)


def test_sync_falls_back_to_the_exchange_bandwidth_until_an_all_reduce_is_measured():
    # No replica group: the all-reduce slope is the exchanges' seconds over their busiest bytes.
    table = SlotTable([[0, 1], [2, 3]], 4)
    sample = measured_sample(TRUTH, table, np.array([[5, 0, 7, 0], [3, 0, 0, 2]]), row_bytes=10, grad_bytes=1,
                             element_bytes=1)
    # Dispatch bytes: 0 -> 1: 70 (expert 2), 1 -> 0: 30 (expert 0): busiest 70, B^T too: 140 bytes moved in
    # the forward exchanges, which took 2 x 5e-5 + 2e-9 x 140 s (the rank that waited least).
    model = CostModel(10, 1, 1, 1)
    model.fit([sample])
    assert model.calibration.sync == Line(0.0, pytest.approx((1e-4 + 2e-9 * 140) / 140))


def test_not_fitted_model_raises():
    with pytest.raises(ValueError, match="not fitted"):
        fresh_model().predict(TWO_RANKS, DEMAND)


@pytest.mark.parametrize("kwargs, match", [
    ({"model_dim": 0}, "model_dim"), ({"element_bytes": 2.0}, "element_bytes"),
    ({"grad_bytes_per_expert": -1}, "grad_bytes_per_expert"), ({"algo": "ring"}, "algo"),
    ({"topology": "local"}, "topology")])
def test_cost_model_rejects_bad_arguments(kwargs, match):
    arguments = {"model_dim": 1, "element_bytes": 1, "grad_bytes_per_expert": 1, "state_bytes_per_expert": 1}
    with pytest.raises(ValueError, match=match):
        CostModel(**{**arguments, **kwargs})


def test_predict_rejects_demand_of_the_wrong_shape_or_sign_and_a_table_of_another_size():
    model = hand_model()
    with pytest.raises(ValueError, match=r"demand must have shape \(2, 4\)"):
        model.predict(TWO_RANKS, np.ones((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="demand must be finite and >= 0"):
        model.predict(TWO_RANKS, -DEMAND)
    with pytest.raises(ValueError, match="demand must hold integers"):
        model.predict(TWO_RANKS, DEMAND * 0.5)
    fitted = fresh_model()
    fitted.fit(four_rank_samples(count=3))
    with pytest.raises(ValueError, match="fitted on 4 ranks, the table has 2"):
        fitted.predict(SlotTable.round_robin(8, 2, 4), np.ones((2, 8), dtype=np.int64))


def test_adjustment_rejects_a_transfer_of_another_table():
    _, transfer = SlotTable.round_robin(4, 2, 4).apply([Migrate(0, 5)])
    with pytest.raises(ValueError, match="transfer covers 8 slots of 4 per rank, the table 2 x 3"):
        hand_model().adjustment_seconds(TWO_RANKS, transfer)


def good_sample_fields():
    return {"demand": DEMAND, "table": TWO_RANKS, "rows": np.array([130, 30]), "compute_s": np.array([0.1, 0.02]),
            "exchange_bytes": np.array([[0, 10], [60, 0]]), "exchange_s": np.array([0.2, 0.2]),
            "sync": ((1, (0, 1), 10, np.array([0.01, 0.01])),), "step_s": 0.4, "element_bytes": 1}


@pytest.mark.parametrize("change, match", [
    ({"rows": np.array([1, 2, 3])}, r"rows must have shape \(2,\)"),
    ({"exchange_bytes": np.zeros((2, 3), dtype=np.int64)}, r"exchange_bytes must have shape \(2, 2\)"),
    ({"compute_s": np.array([0.1, -0.1])}, "compute_s must be finite and >= 0"),
    ({"exchange_s": np.array([0.1, np.nan])}, "exchange_s must be finite"),
    ({"demand": np.ones((3, 4), dtype=np.int64)}, r"demand must have shape \(2, 4\)"),
    ({"step_s": -1.0}, "step_s must be a finite number >= 0"),
    ({"element_bytes": 0}, "element_bytes must be a positive integer"),
    ({"sync": ((1, (0,), 10, np.zeros(2)),)}, r"sync\[0\]: ranks must be 2 or more"),
    ({"sync": ((9, (0, 1), 10, np.zeros(2)),)}, r"sync\[0\]: expert must be an integer in \[0, 4\)"),
    ({"sync": ((1, (0, 1), 10, np.array([0.1, np.nan])),)}, "members' seconds must be finite"),
    ({"sync": ((2, (0, 1), 1, np.zeros(2)), (1, (0, 1), 1, np.zeros(2)))}, "ascending order"),
    ({"sync": ((1, (0, 1), 10),)}, r"sync\[0\] must be \(expert, ranks, nbytes, seconds\)")])
def test_step_sample_rejects_bad_fields(change, match):
    with pytest.raises(ValueError, match=match):
        StepSample(**{**good_sample_fields(), **change})


def test_step_sample_needs_a_slot_table_and_fit_needs_samples():
    with pytest.raises(TypeError, match="table must be a SlotTable"):
        StepSample(**{**good_sample_fields(), "table": [[0, 1, 2], [3, 1, 2]]})
    with pytest.raises(ValueError, match="at least one StepSample"):
        hand_model().fit([])
    with pytest.raises(ValueError, match="element_bytes"):
        CostModel(1, 2, 1, 1).fit([StepSample(**good_sample_fields())])
