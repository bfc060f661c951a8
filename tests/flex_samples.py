"""Synthetic FlexMoE measurements from known cost parameters, and the
hand-worked cases, for the tests of moe_runtime.flex.cost and
moe_runtime.flex.scheduler.

:func:`measured_sample` plays the layer: it routes a demand over a table
(Algorithm 3) and writes down what a machine with the given true parameters
would measure, waits included (a fast rank waits for the slowest in the
exchange, non-minimal members of an all-reduce wait too), so a fit must
recover the parameters through the min-over-ranks rule. The step's time
is written out here term by term, not taken from the cost model.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.flex.cost import Calibration, CostModel, Line, StepSample
from moe_runtime.flex.routing import rank_loads, route
from moe_runtime.flex.vexperts import SlotTable


def off_rank_busiest(matrix: np.ndarray) -> float:
    """max over ranks of max(bytes sent to others, bytes received from others)."""
    off = np.array(matrix, dtype=np.int64)
    off[np.diag_indices_from(off)] = 0
    return float(max(off.sum(axis=1).max(), off.sum(axis=0).max()))


def skewed_demand(ranks: int, experts: int, tokens: int, exponent: float, seed: int) -> np.ndarray:
    """(W, E) int64: each rank's `tokens` choices drawn from a Zipf-like popularity
    p_e ~ 1 / (e + 1)^exponent (expert 0 the hottest)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** exponent
    return rng.multinomial(tokens, popularity / popularity.sum(), size=ranks).astype(np.int64)


def measured_sample(truth: Calibration, table: SlotTable, demand: np.ndarray, *, row_bytes: int,
                    grad_bytes: int, element_bytes: int = 4, topology=None, noise: float = 0.0,
                    seed: int = 0) -> StepSample:
    """What a machine with parameters `truth` measures running `demand` over `table`
    (`noise`: relative standard deviation of every time, seeded)."""
    rng = np.random.default_rng(seed)

    def jitter(seconds):
        return seconds * (1.0 + noise * rng.standard_normal(np.shape(seconds)))

    sends = route(demand, table.replicas())
    rows = rank_loads(sends)
    dispatch = sends.sum(axis=0) * row_bytes
    compute = truth.compute.intercept + truth.compute.slope * rows
    shape = _shape(dispatch, topology) + _shape(dispatch.T, topology)
    forward = 2 * truth.exchange.intercept + truth.exchange.slope * shape
    waits = compute.max() - compute  # the fast ranks wait for the slowest one in the dispatch
    sync, sync_total = [], 0.0
    for expert, ranks in table.replica_groups():
        k = len(ranks)
        seconds = np.full(table.ranks, np.nan)
        alone = truth.sync.intercept + truth.sync.slope * 2.0 * (k - 1) / k * grad_bytes
        seconds[list(ranks)] = alone + 1e-4 * np.arange(k)  # later members wait a little
        sync.append((expert, ranks, grad_bytes, jitter(seconds)))
        sync_total += alone
    step = compute.max() + 2 * forward + sync_total + truth.other_s
    return StepSample(demand=demand, table=table, rows=rows, compute_s=jitter(compute),
                      exchange_bytes=dispatch, exchange_s=jitter(forward + waits), sync=tuple(sync),
                      step_s=float(jitter(step)), element_bytes=element_bytes)


def _shape(matrix: np.ndarray, topology) -> float:
    if topology is None:
        return off_rank_busiest(matrix)
    from a2a import sim

    return sim.predict_v(topology, "linear", matrix).time_s


# The hand-worked cases: 1 ms per row computed, per byte exchanged (rows of 1 byte) and per byte all-reduced.
MS = 1e-3
HAND = Calibration(Line(0.0, MS), Line(0.0, MS), Line(0.0, MS), 0.0)
TWO_RANKS = SlotTable([[0, 1, 2], [3, 1, 2]], 4)  # experts 1 and 2 on both ranks
DEMAND = np.array([[60, 5, 5, 10], [60, 5, 5, 10]])


def hand_model(grad_bytes=10, state_bytes=100, calibration=HAND):
    """The cost model of the hand-worked cases (rows of one byte)."""
    return CostModel(model_dim=1, element_bytes=1, grad_bytes_per_expert=grad_bytes,
                     state_bytes_per_expert=state_bytes, calibration=calibration)


# The synthetic machine of the fitting tests: 4 ranks, 8 experts, rows of 64 float32.
TRUTH = Calibration(compute=Line(2e-4, 3e-6), exchange=Line(5e-5, 2e-9), sync=Line(1e-4, 4e-9), other_s=3e-3)
MODEL_DIM, ELEMENT_BYTES, GRAD_BYTES, STATE_BYTES = 64, 4, 100_000, 300_000


def four_rank_samples(truth=TRUTH, topology=None, noise=0.0, count=8):
    """Samples on 4 ranks, 8 experts, varied demands and tables (replica groups of 2 and 3 ranks)."""
    tables = [SlotTable.round_robin(8, 4, 4),  # every expert on 2 ranks
              SlotTable([[0, 1, 2, 3], [0, 4, 5, 6], [0, 7, 1, 2], [3, 4, 5, 6]], 8),  # expert 0 on 3 ranks
              SlotTable([[0, 1, 0, 2], [3, 4, 5, 1], [6, 7, 2, 3], [4, 5, 6, 7]], 8)]
    samples = []
    for index in range(count):
        demand = skewed_demand(4, 8, 200 + 150 * index, 0.6 + 0.2 * (index % 3), seed=index)
        samples.append(measured_sample(truth, tables[index % 3], demand, row_bytes=MODEL_DIM * ELEMENT_BYTES,
                                       grad_bytes=GRAD_BYTES, element_bytes=ELEMENT_BYTES, topology=topology,
                                       noise=noise, seed=100 + index))
    return samples


def fresh_model(topology=None):
    """An unfitted cost model of the synthetic machine."""
    return CostModel(MODEL_DIM, ELEMENT_BYTES, GRAD_BYTES, STATE_BYTES, topology=topology)
