"""FlexMoE's cost model of one MoE step (Section 3.4, Equations 5 and 7-9).

The layer measures every step and hands a :class:`StepSample` (every array
gathered from all ranks, so the same on every rank); :meth:`CostModel.fit`
calibrates the model on a window of them and :meth:`CostModel.predict`
prices a placement table under a demand (I_{e,g}, (W, E)) before it runs:

    T = T_C + T_A2A + T_Sync + T_other                                   (Eq. 5)

    T_C     = c_0 + max_g rows_g / TPS                                   (Eq. 7, slowest rank)
    T_A2A   = 2 (x(B) + x(B^T))                                          (Eq. 8, 4 exchanges)
              x(M) = a_x + k_x shape(M): one exchange of the (W, W) bytes M
    T_Sync  = sum over replica groups (e, ranks) of a_s + r(k) size_e / BPS   (Eq. 9)
              r(k) = 2 (k - 1) / k: the bytes a ring all-reduce moves per byte, k = |ranks|
    T_other = the mean of what the parts leave unexplained in step_s

rows_g = rank_loads(route(demand, table.replicas())) (Algorithm 3), and B the
dispatch's bytes, B[g, h] = rows g sends to h times model_dim x element_bytes;
the return exchange is B^T, and the backward runs the same two again.
``shape(M)``: with no topology, Eq. 8 with one bandwidth: the busiest rank's
off-rank bytes, max over g of max(sent_g, received_g) (links are full
duplex; a message to oneself is free); with an ``a2a.sim`` topology, the
time a2a.sim.predict_v predicts for ``all_to_all_v`` of M, calibrated by
the job (k_x scales it to this machine).

The adjustment of a plan (Section 3.4 "Expert Adjustment Cost") is one
exchange of the states it moves: x(A), A[g, h] = the slots rank g sends rank
h (vexperts.Transfer.messages) times ``state_bytes_per_expert``.

Fitting (every line by non-negative least squares, :func:`fit_line`):
``compute_s`` against rows over every (sample, rank); the forward exchanges'
``exchange_s`` (min over ranks: the rank that waited least) against
shape(B) + shape(B^T); each all-reduce's seconds (min over its members)
against r(k) nbytes; until an all-reduce is measured, BPS is the exchanges'
measured bandwidth (the busiest rank's off-rank bytes over their time).
Every number is a function of the samples only, so every rank computes the
same model.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .routing import rank_loads, route
from .vexperts import SlotTable, Transfer

__all__ = ["Breakdown", "Calibration", "CostModel", "Line", "StepSample", "Terms", "busiest_bytes", "checked_demand", "fit_line",
           "ring_factor"]


@dataclass(frozen=True, eq=False)
class StepSample:
    """What the layer measured in one step, gathered from all ranks (same on every rank).

    ``demand`` (W, E) int64: the gate's choices of expert e on rank g.
    ``table``: the SlotTable the step ran with.
    ``rows`` (W,) int64: rows each rank's experts computed.
    ``compute_s`` (W,) float64: expert FFN seconds per rank, forward + backward.
    ``exchange_bytes`` (W, W) int64: bytes rank g sent rank h in the dispatch.
    ``exchange_s`` (W,) float64: seconds per rank in the two forward exchanges, waits included.
    ``sync``: ((expert, ranks, nbytes, seconds (W,) with NaN off the group), ...), ascending expert.
    ``step_s``: the layer's forward + backward seconds, max over ranks.
    ``element_bytes``: bytes of one row element.
    Validated and made read-only on construction; compared and hashed by identity.
    """

    demand: np.ndarray
    table: SlotTable
    rows: np.ndarray
    compute_s: np.ndarray
    exchange_bytes: np.ndarray
    exchange_s: np.ndarray
    sync: tuple
    step_s: float
    element_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.table, SlotTable):
            raise TypeError(f"StepSample: table must be a SlotTable, got {type(self.table).__name__}")
        ranks, experts = self.table.ranks, self.table.num_experts
        arrays = {"demand": (np.int64, (ranks, experts)), "rows": (np.int64, (ranks,)),
                  "compute_s": (np.float64, (ranks,)), "exchange_bytes": (np.int64, (ranks, ranks)),
                  "exchange_s": (np.float64, (ranks,))}
        for name, (dtype, shape) in arrays.items():
            object.__setattr__(self, name, _checked_array(f"StepSample.{name}", getattr(self, name), dtype, shape))
        sync = tuple(_checked_sync(entry, index, ranks, experts) for index, entry in enumerate(self.sync))
        order = [entry[0] for entry in sync]
        if order != sorted(set(order)):
            raise ValueError(f"StepSample.sync: one entry per expert in ascending order, got experts {order}")
        object.__setattr__(self, "sync", sync)
        object.__setattr__(self, "step_s", _non_negative("StepSample.step_s", self.step_s))
        if not _is_int(self.element_bytes) or self.element_bytes < 1:
            raise ValueError(f"StepSample.element_bytes must be a positive integer, got {self.element_bytes!r}")


@dataclass(frozen=True)
class Breakdown:
    """A predicted step (seconds): Equation 5's parts and their sum."""

    compute_s: float
    a2a_s: float
    sync_s: float
    other_s: float
    total_s: float


@dataclass(frozen=True)
class Line:
    """seconds = intercept + slope x, both >= 0."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters (see the module docstring).

    ``compute``: one rank's FFN seconds against its rows (slope = 1 / TPS).
    ``exchange``: one exchange's seconds against shape(M) (k_x; 1 / bandwidth without a topology).
    ``sync``: one all-reduce's seconds against r(k) bytes (slope = 1 / BPS).
    ``other_s``: the rest of the step (may be negative where the measured parts overlap).
    ``samples``: how many samples it was fitted on; ``ranks``: their W (0: any)."""

    compute: Line
    exchange: Line
    sync: Line
    other_s: float
    samples: int = 0
    ranks: int = 0

    def predict(self, terms: Terms) -> Breakdown:
        """Equation 5 from these parameters and `terms` (CostModel.terms)."""
        if self.ranks and terms.ranks != self.ranks:
            raise ValueError(f"CostModel.predict: the model was fitted on {self.ranks} ranks, the table has "
                             f"{terms.ranks}")
        compute = self.compute(terms.max_rows)  # Eq. 7 on the slowest rank
        a2a = 2.0 * (2.0 * self.exchange.intercept + self.exchange.slope * terms.exchange_shape)  # Eq. 8
        sync = terms.groups * self.sync.intercept + self.sync.slope * terms.group_bytes  # Eq. 9
        return Breakdown(compute, a2a, sync, self.other_s, compute + a2a + sync + self.other_s)


@dataclass(frozen=True)
class Terms:
    """The quantities Equation 5 is linear in, for one table and demand:
    ``max_rows`` (max_g rows_g), ``exchange_shape`` (shape(B) + shape(B^T)),
    ``groups`` (replica groups) and ``group_bytes`` (sum of r(k) size_e over them)."""

    ranks: int
    max_rows: float
    exchange_shape: float
    groups: int
    group_bytes: float


def fit_line(x: np.ndarray, y: np.ndarray) -> Line:
    """Least squares y = a + b x subject to a, b >= 0: the best of the free fit
    (when feasible), the line through the origin (Eq. 7's form; preferred when
    x does not vary) and the flat line. Ties go to that order."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size == 0 or x.shape != y.shape:
        raise ValueError(f"fit_line: needs as many x as y, at least one, got {x.shape} and {y.shape}")
    candidates = []
    spread = x - x.mean()
    if (spread**2).sum() > 1e-18 * float((x**2).sum()):  # x varies beyond rounding
        slope = float(spread @ (y - y.mean()) / (spread @ spread))
        candidates.append(Line(float(y.mean() - slope * x.mean()), slope))
    xx = float(x @ x)
    candidates.append(Line(0.0, max(0.0, float(x @ y) / xx) if xx > 0 else 0.0))
    candidates.append(Line(max(0.0, float(y.mean())), 0.0))
    feasible = [line for line in candidates if line.intercept >= 0 and line.slope >= 0]
    errors = [float(((line.intercept + line.slope * x - y) ** 2).sum()) for line in feasible]
    return feasible[int(np.argmin(errors))]


def ring_factor(group_size: int) -> float:
    """r(k) = 2 (k - 1) / k: bytes a ring all-reduce moves per byte of the buffer."""
    return 2.0 * (group_size - 1) / group_size


class CostModel:
    """Equation 5's model of one step, calibrated on the job's StepSamples.

    ``model_dim``: elements of a row; ``element_bytes``: bytes of one;
    ``grad_bytes_per_expert``: the bytes one replica all-reduce moves (size_e);
    ``state_bytes_per_expert``: the bytes an Expand or Migrate sends per slot
    (parameters and optimizer state); ``topology``: an ``a2a.sim.Topology``
    of the job's W ranks for the exchanges' shape, or None (Eq. 8 with one
    bandwidth); ``algo``: the all-to-all algorithm the dispatch runs.
    ``calibration``: parameters to start from (else :meth:`fit` them).
    """

    def __init__(self, model_dim: int, element_bytes: int, grad_bytes_per_expert: int,
                 state_bytes_per_expert: int, topology: object | None = None, algo: str = "linear",
                 calibration: Calibration | None = None):
        for name, value, least in (("model_dim", model_dim, 1), ("element_bytes", element_bytes, 1),
                                   ("grad_bytes_per_expert", grad_bytes_per_expert, 0),
                                   ("state_bytes_per_expert", state_bytes_per_expert, 0)):
            if not _is_int(value) or value < least:
                raise ValueError(f"CostModel: {name} must be an integer >= {least}, got {value!r}")
        if algo not in ("linear", "2dh"):
            raise ValueError(f"CostModel: algo must be 'linear' or '2dh', got {algo!r}")
        if topology is not None and not hasattr(topology, "ranks"):
            raise ValueError(f"CostModel: topology must be an a2a.sim.Topology or None, got {topology!r}")
        self.element_bytes, self.row_bytes = element_bytes, model_dim * element_bytes
        self.grad_bytes_per_expert = grad_bytes_per_expert
        self.state_bytes_per_expert = state_bytes_per_expert
        self.topology, self.algo = topology, algo
        self.calibration = calibration
        self._terms_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def fitted(self) -> bool:
        return self.calibration is not None

    # -- the parts -----------------------------------------------------------

    def exchange_shape(self, matrix: np.ndarray) -> float:
        """shape(M) of one exchange of the (W, W) bytes M (see the module docstring)."""
        matrix = np.asarray(matrix, dtype=np.int64)
        if self.topology is not None:
            from a2a.sim import predict_v  # the scale model; only needed with a topology

            if self.topology.ranks != matrix.shape[0]:
                raise ValueError(f"CostModel: the topology has {self.topology.ranks} ranks, the exchange "
                                 f"{matrix.shape[0]}")
            return predict_v(self.topology, self.algo, matrix).time_s
        return busiest_bytes(matrix)

    def _exchanges_shape(self, dispatch: np.ndarray) -> float:
        """shape(B) + shape(B^T): the dispatch and the return."""
        return self.exchange_shape(dispatch) + self.exchange_shape(dispatch.T)

    def terms(self, table: SlotTable, demand: np.ndarray) -> Terms:
        """What Equation 5 needs of `table` and `demand` besides the calibration."""
        demand = checked_demand(demand, table)
        sends = route(demand, table.replicas())
        groups = [ring_factor(len(ranks)) * self.grad_bytes_per_expert for _, ranks in table.replica_groups()]
        return Terms(ranks=table.ranks, max_rows=float(rank_loads(sends).max()),
                     exchange_shape=self._exchanges_shape(sends.sum(axis=0) * self.row_bytes),
                     groups=len(groups), group_bytes=float(sum(groups)))

    def predict(self, table: SlotTable, demand: np.ndarray) -> Breakdown:
        """Equation 5 for `table` under `demand` (W, E)."""
        return self._calibration().predict(self.terms(table, demand))

    def adjustment_seconds(self, table: SlotTable, transfer: Transfer) -> float:
        """One exchange of the states `transfer` moves off their rank (0 when none moves)."""
        if transfer.source.size != table.slots.size or transfer.slots_per_rank != table.slots_per_rank:
            raise ValueError(f"CostModel.adjustment_seconds: the transfer covers {transfer.source.size} slots "
                             f"of {transfer.slots_per_rank} per rank, the table {table.ranks} x "
                             f"{table.slots_per_rank}")
        matrix = np.zeros((table.ranks, table.ranks), dtype=np.int64)
        for (src, dst), slots in transfer.messages().items():
            matrix[src, dst] = slots * self.state_bytes_per_expert
        if not matrix.any():
            return 0.0
        return self._calibration().exchange(self.exchange_shape(matrix))

    # -- calibration ---------------------------------------------------------

    def fit(self, samples: Sequence[StepSample]) -> Calibration:
        """Calibrate on `samples` (see the module docstring); returns and keeps the parameters."""
        samples = list(samples)
        if not samples or not all(isinstance(s, StepSample) for s in samples):
            raise ValueError("CostModel.fit: needs at least one StepSample, and only StepSamples")
        ranks = {s.table.ranks for s in samples}
        if len(ranks) != 1:
            raise ValueError(f"CostModel.fit: the samples come from different world sizes {sorted(ranks)}")
        element_bytes = {s.element_bytes for s in samples} - {self.element_bytes}
        if element_bytes:
            raise ValueError(f"CostModel.fit: samples of element_bytes {sorted(element_bytes)}, the model's rows "
                             f"have {self.element_bytes}")
        compute = fit_line(np.concatenate([s.rows for s in samples]),
                           np.concatenate([s.compute_s for s in samples]))
        cached = [self._sample_terms(s) for s in samples]
        two = fit_line(np.array([measured for measured, _ in cached]), np.array([s.exchange_s.min() for s in samples]))
        exchange = Line(two.intercept / 2.0, two.slope)
        width = samples[0].table.ranks
        partial = Calibration(compute, exchange, self._fit_sync(samples), 0.0, len(samples), width)
        other = float(np.mean([s.step_s - partial.predict(terms).total_s for s, (_, terms) in zip(samples, cached)]))
        self.calibration = Calibration(compute, exchange, partial.sync, other, len(samples), width)
        return self.calibration

    def _sample_terms(self, sample: StepSample) -> tuple[float, Terms]:
        """shape(B) + shape(B^T) of the measured dispatch, and the sample's Terms; computed
        once per sample (a Scheduler refits on its window every step)."""
        if sample not in self._terms_of:
            self._terms_of[sample] = (self._exchanges_shape(sample.exchange_bytes),
                                      self.terms(sample.table, sample.demand))
        return self._terms_of[sample]

    def _fit_sync(self, samples: Sequence[StepSample]) -> Line:
        entries = [(ring_factor(len(ranks)) * nbytes, float(np.nanmin(seconds)))
                   for s in samples for _, ranks, nbytes, seconds in s.sync]
        if entries:
            x, y = np.array(entries).T
            return fit_line(x, y)
        moved = sum(busiest_bytes(s.exchange_bytes) + busiest_bytes(s.exchange_bytes.T) for s in samples)
        spent = sum(float(s.exchange_s.min()) for s in samples)
        return Line(0.0, spent / moved if moved > 0 else 0.0)

    def error(self, samples: Sequence[StepSample]) -> np.ndarray:
        """(N,) signed relative errors (predicted total_s - step_s) / step_s, one per sample."""
        return np.array([(self.predict(s.table, s.demand).total_s - s.step_s) / s.step_s
                         if s.step_s > 0 else math.inf for s in samples], dtype=np.float64)

    def parameters(self) -> dict[str, float]:
        """The fitted parameters in the paper's terms (for reports): TPS (rows / s),
        the exchange's a_x and k_x, BPS, the all-reduce latency, other_s."""
        c = self._calibration()
        return {"compute_intercept_s": c.compute.intercept, "tps": _inverse(c.compute.slope),
                "exchange_latency_s": c.exchange.intercept, "exchange_scale": c.exchange.slope,
                "sync_latency_s": c.sync.intercept, "bps": _inverse(c.sync.slope), "other_s": c.other_s}

    def _calibration(self) -> Calibration:
        if self.calibration is None:
            raise ValueError("CostModel: not fitted yet; call fit(samples) or pass calibration=")
        return self.calibration


def busiest_bytes(matrix: np.ndarray) -> float:
    """Equation 8's shape with one bandwidth: max over ranks g of max(bytes g sends
    off-rank, bytes g receives off-rank)."""
    off = np.asarray(matrix, dtype=np.int64).copy()
    np.fill_diagonal(off, 0)
    return float(max(off.sum(axis=1).max(initial=0), off.sum(axis=0).max(initial=0)))


def _inverse(slope: float) -> float:
    return math.inf if slope == 0 else 1.0 / slope


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _checked_array(name: str, value: object, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(value)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (from the table), got {array.shape}")
    if dtype is np.int64 and array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    array = array.astype(dtype, copy=True)
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError(f"{name} must be finite and >= 0, got {array.tolist()}")
    array.setflags(write=False)
    return array


def _checked_sync(entry: object, index: int, ranks: int, experts: int) -> tuple:
    where = f"StepSample.sync[{index}]"
    if not isinstance(entry, tuple) or len(entry) != 4:
        raise ValueError(f"{where} must be (expert, ranks, nbytes, seconds), got {entry!r}")
    expert, members, nbytes, seconds = entry
    if not _is_int(expert) or not 0 <= expert < experts:
        raise ValueError(f"{where}: expert must be an integer in [0, {experts}), got {expert!r}")
    members = tuple(int(r) for r in members)
    if len(members) < 2 or len(set(members)) != len(members) or not all(0 <= r < ranks for r in members):
        raise ValueError(f"{where}: ranks must be 2 or more distinct ranks in [0, {ranks}), got {members}")
    if not _is_int(nbytes) or nbytes < 0:
        raise ValueError(f"{where}: nbytes must be an integer >= 0, got {nbytes!r}")
    seconds = np.asarray(seconds, dtype=np.float64)
    if seconds.shape != (ranks,):
        raise ValueError(f"{where}: seconds must have shape ({ranks},), got {seconds.shape}")
    inside = seconds[list(members)]
    if not np.isfinite(inside).all() or (inside < 0).any():
        raise ValueError(f"{where}: the members' seconds must be finite and >= 0, got {inside.tolist()}")
    return int(expert), members, int(nbytes), seconds


def checked_demand(demand: object, table: SlotTable) -> np.ndarray:
    """`demand` as a read-only (W, E) int64 array that fits `table`, or a ValueError."""
    if not isinstance(table, SlotTable):
        raise TypeError(f"table must be a SlotTable, got {type(table).__name__}")
    return _checked_array("demand", demand, np.int64, (table.ranks, table.num_experts))
