"""The alpha-beta model: the time of each phase of a2a's all-to-all algorithms
on a :class:`Topology`.

The phases are those of ``csrc/core/algorithms.cpp`` (docs/algorithms.md), one
:class:`Phase` each, so a predicted phase is what the code does:

* ``linear``: ``check`` (the argument check: in band, the cost of carrying
  it in the exchange; by round, a round of its own), ``exchange`` (one
  all-to-all over the world).
* ``2dh``: ``check``, ``copy1`` (stride copy ``[N][L] -> [L][N]``), ``intra``
  (all-to-all inside the node), ``copy2`` (``[L][N] -> [N][L]``), ``inter``
  (all-to-all along the rail). One node or one rank per node: the linear phases.
* flex: ``pack`` / ``unpack`` (the strided side's transpose, or MPI walking an
  ``hvector``) around the phases of its exchange; the ``pieces`` path sends
  ``S / W / piece`` messages per peer.
* v: ``counts`` (the plan's count exchange), ``relay counts`` (2DH's), then the
  uniform phases with every message at its own size, the slowest rank setting
  each phase (phases end together: every rank waits for its peers).

A message of ``m`` bytes on a link of bandwidth ``B`` and half-message ``h``
moves at ``B * m / (m + h)`` (Tutel, Figure 16: small messages do not saturate
InfiniBand), so ``n`` messages of ``m`` bytes take ``n (m + h) / B``: the
bytes at full bandwidth plus a fixed cost of ``h / B`` per message. A phase
pays its link's latency once. docs/scaling.md has every formula.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .topology import CHECKS, Topology

__all__ = [
    "ALGOS",
    "CHECKS",
    "FORMS",
    "Phase",
    "Prediction",
    "Topology",
    "crossover",
    "flex_layout",
    "flex_path",
    "power_of_two_ranks",
    "predict",
    "predict_flex",
    "predict_v",
]

ALGOS = ("linear", "2dh")
FORMS = ("linear", "2dh", "flex", "combine", "v", "v-plan")  # the rows a2a.bench writes (and the model predicts)

# Constants of the implementation (csrc/core/comm.cpp, csrc/core/algorithms.cpp).
MIN_PIECE_BYTES = 64 << 10  # flex pieces path: pieces at least this big...
MAX_PIECES_PER_PEER = 64  # ...and at most this many per peer
MIN_DATATYPE_CHUNK_BYTES = 64 << 10  # flex datatypes path from this many bytes per peer
COUNT_BYTES = 8  # all-to-all-v: one int64 count per peer




@dataclass(frozen=True)
class Phase:
    """One phase: its name, its time, the bytes one rank sends in it (or
    copies) and the messages it sends (or chunks it copies); the slowest rank's."""

    name: str
    time_s: float
    bytes: int
    messages: int


@dataclass(frozen=True)
class Prediction:
    """The predicted time of one collective call (seconds) and of each phase."""

    time_s: float
    phases: tuple[Phase, ...]
    algo: str
    size: int  # bytes each rank sends (the mean for v)
    ranks: int

    @property
    def busbw(self) -> float:
        """nccl-tests' bus bandwidth, bytes per second: size / time * (W - 1) / W."""
        if self.time_s <= 0:
            return math.inf
        return self.size / self.time_s * (self.ranks - 1) / self.ranks

    def phase_times(self) -> dict[str, float]:
        return {p.name: p.time_s for p in self.phases}


# ---------------------------------------------------------------------------
# Links

# A rank's messages of one phase, by the link they take: per kind, arrays over
# ranks (or scalars) of the message count and the bytes, each for the sending
# and the receiving side (a link is full duplex: the busier side sets the time).
_KINDS = ("self", "intra", "rail", "cross")


@dataclass
class _Traffic:
    sends: dict[str, tuple[Any, Any]]  # kind -> (messages, bytes)
    recvs: dict[str, tuple[Any, Any]]

    @classmethod
    def symmetric(cls, kinds: Mapping[str, tuple[Any, Any]]) -> _Traffic:
        return cls(dict(kinds), dict(kinds))


def _kind_time(top: Topology, kind: str, messages: Any, nbytes: Any) -> Any:
    """Seconds to move `messages` messages of `nbytes` bytes in all over one link kind."""
    if kind == "self":  # a message to oneself is a copy inside the rank
        return (nbytes + messages * top.copy_half_chunk) / top.copy_bandwidth
    if kind == "intra" or top.emulated:
        return (nbytes + messages * top.intra_half_message) / top.intra_bandwidth
    # On one host a rank's sockets cost its own (shared) core's time: no NIC divided among the node's ranks.
    per_rank = top.nic_bandwidth if top.one_host else top.nic_bandwidth * top.nics_per_node / top.local_size
    if kind == "cross":
        per_rank *= top.cross_rail_factor
    return (nbytes + messages * top.inter_half_message) / per_rank


def _kind_latency(top: Topology, kind: str) -> float:
    if kind == "self":
        return 0.0
    if kind == "intra" or top.emulated:
        return top.intra_latency
    return top.inter_latency


def _link_of(top: Topology, kind: str) -> str:
    """The resource a kind of message uses: the rank's own copy, its NVLink, its share of the NICs.
    Rail and cross-rail messages share the NICs; on an emulated host every message shares one link."""
    if kind == "self":
        return "self"
    return "intra" if kind == "intra" or top.emulated else "inter"


def _exchange_phase(top: Topology, name: str, traffic: _Traffic) -> Phase:
    """An exchange: the latency of its slowest link, plus its links' times, at
    once (concurrent) or one after another; the slowest rank's."""
    latency = 0.0
    links: dict[str, Any] = {}
    total_messages: Any = 0
    total_bytes: Any = 0
    for kind in _KINDS:
        send, recv = traffic.sends.get(kind), traffic.recvs.get(kind)
        sides = [side for side in (send, recv) if side is not None]
        if not sides:
            continue
        # A link is full duplex: the busier of the sending and the receiving side sets its time.
        part = np.maximum.reduce([np.asarray(_kind_time(top, kind, *side), dtype=float) for side in sides])
        if max(np.max(side[0]) for side in sides) > 0:
            latency = max(latency, _kind_latency(top, kind))
        link = _link_of(top, kind)
        links[link] = links.get(link, 0.0) + part
        if send is not None:
            total_messages = total_messages + np.asarray(send[0])
            total_bytes = total_bytes + np.asarray(send[1])
    if not links:
        return Phase(name, 0.0, 0, 0)
    parts = list(links.values())
    combined = np.maximum.reduce(parts) if top.concurrent else np.add.reduce(parts)
    seconds = (latency + float(np.max(combined))) * _sharing(top)
    if top.link_rate > 0:  # the wire runs while the cores work: the longer of the two, not their sum
        seconds = max(seconds, _wire_time(top, traffic))
    return Phase(name, seconds, int(np.max(total_bytes)), int(np.max(total_messages)))


def _wire_time(top: Topology, traffic: _Traffic) -> float:
    """Seconds a shaped node link needs for the phase: the busiest node's bytes to
    other nodes, or from them (each end of the link is shaped), over the payload's rate."""
    busiest = 0.0
    for side in (traffic.sends, traffic.recvs):
        per_rank = sum((np.asarray(side[kind][1], dtype=float) for kind in ("rail", "cross") if kind in side),
                       np.zeros(top.ranks))  # ranks are numbered node by node
        busiest = max(busiest, float(per_rank.reshape(top.nodes, top.local_size).sum(axis=1).max()))
    return busiest / (top.link_rate * top.link_efficiency)


def _copy_phase(top: Topology, name: str, nbytes: Any, chunks: Any) -> Phase:
    """A local copy of `nbytes` bytes in `chunks` contiguous pieces (the slowest rank's)."""
    nbytes, chunks = np.max(nbytes), np.max(chunks)
    seconds = top.copy_latency + (nbytes + chunks * top.copy_half_chunk) * _seconds_per_copied_byte(top, nbytes)
    return Phase(name, float(seconds) * _sharing(top), int(nbytes), int(chunks))


def _seconds_per_copied_byte(top: Topology, nbytes: Any) -> Any:
    """1 / copy_bandwidth; with a cache, the share of the bytes that miss it at memory speed."""
    if not (top.cache_bytes > 0 and top.copy_memory_bandwidth > 0):
        return 1.0 / top.copy_bandwidth
    ranks_on_host = top.ranks if _one_host(top) else top.local_size
    working_set = 2.0 * nbytes * ranks_on_host  # read and written, by every rank of the host
    hit = top.cache_bytes / (top.cache_bytes + working_set)
    return hit / top.copy_bandwidth + (1 - hit) / top.copy_memory_bandwidth


def _one_host(top: Topology) -> bool:
    """Whether every rank of the job runs on one host (emulated nodes, or the namespace cluster)."""
    return top.emulated or top.one_host


def _sharing(top: Topology) -> float:
    """How much longer everything takes when the ranks share the host's cores."""
    if _one_host(top) and top.cores:
        return max(1.0, top.ranks / top.cores) ** top.sharing_exponent
    return 1.0


def _uniform_traffic(top: Topology, group: str, nbytes: int) -> _Traffic:
    """Every rank sends `nbytes` to each member of `group` ("world", "node", "rail")."""
    nodes, local = top.nodes, top.local_size
    if group == "world":
        kinds = {"self": (1, nbytes), "intra": (local - 1, (local - 1) * nbytes),
                 "rail": (nodes - 1, (nodes - 1) * nbytes),
                 "cross": ((nodes - 1) * (local - 1), (nodes - 1) * (local - 1) * nbytes)}
    elif group == "node":
        kinds = {"self": (1, nbytes), "intra": (local - 1, (local - 1) * nbytes)}
    else:
        kinds = {"self": (1, nbytes), "rail": (nodes - 1, (nodes - 1) * nbytes)}
    if nbytes == 0:  # zero-byte messages are skipped (a labelled exchange posts them, at no modelled cost)
        kinds = {kind: (0, 0) for kind in kinds}
    return _Traffic.symmetric(kinds)


def _check_phases(top: Topology, carried_by: Sequence[_Traffic]) -> list[Phase]:
    """The argument check of one call. ``in_band`` (MPI communicators): it travels
    in the call's own exchanges, `carried_by` (every labelled exchange: linear's
    one, 2DH's two), and costs ``in_band_cost`` times their CPU time (the labels,
    the probes of waiting peers: no byte more on a wire). ``round`` (NCCL): an
    allgather of the signatures, ``ceil(log2 W)`` latencies. ``none``: nothing.
    Until 2026-11-28 2DH paid a round of empty messages over the world for it
    (the fits' data before then, docs/scaling.md)."""
    if top.check == "none":
        return []
    if top.check == "round":
        rounds = max(1, math.ceil(math.log2(top.ranks))) if top.ranks > 1 else 0
        latency = top.inter_latency if top.nodes > 1 and not top.emulated else top.intra_latency
        return [Phase("check", rounds * latency * _sharing(top), 0, rounds)]
    cpu = top.replace(link_rate=0.0)
    carried = sum(_exchange_phase(cpu, "check", traffic).time_s for traffic in carried_by)
    return [Phase("check", carried * top.in_band_cost, 0, 0)]


# ---------------------------------------------------------------------------
# Uniform all-to-all


def _check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    return int(value)


def _uniform_phases(top: Topology, algo: str, chunk: int) -> list[Phase]:
    """The phases of a uniform all-to-all of `chunk` bytes per peer, its check included."""
    if algo == "linear" or not top.two_level:
        exchange = _uniform_traffic(top, "world", chunk)
        return [*_check_phases(top, [exchange]), _exchange_phase(top, "exchange", exchange)]
    size = chunk * top.ranks
    intra = _uniform_traffic(top, "node", chunk * top.nodes)
    inter = _uniform_traffic(top, "rail", chunk * top.local_size)
    return [
        *_check_phases(top, [intra, inter]),
        _copy_phase(top, "copy1", size, top.ranks),
        _exchange_phase(top, "intra", intra),
        _copy_phase(top, "copy2", size, top.ranks),
        _exchange_phase(top, "inter", inter),
    ]


def _prediction(phases: Sequence[Phase], algo: str, size: int, ranks: int) -> Prediction:
    return Prediction(sum(p.time_s for p in phases), tuple(phases), algo, size, ranks)


def predict(topology: Topology, algo: str, size_bytes: int) -> Prediction:
    """The uniform all-to-all (``a2a.all_to_all``) of `size_bytes` bytes per rank
    (``size_bytes // W`` to each peer, as ``python -m a2a.bench`` counts it) with
    `algo` ("linear" or "2dh") on `topology`: its time and the time of each phase."""
    _check_algo(algo)
    size = _check_size("size_bytes", size_bytes)
    chunk = size // topology.ranks
    return _prediction(_uniform_phases(topology, algo, chunk), algo, chunk * topology.ranks, topology.ranks)


# ---------------------------------------------------------------------------
# Flexible all-to-all


@dataclass(frozen=True)
class FlexLayout:
    """The two 3-D views of ``csrc/core/algorithms.hpp``'s FlexLayout (bytes)."""

    split_outer: int
    split_inner: int
    concat_outer: int
    concat_inner: int

    @property
    def chunk_bytes(self) -> int:
        return self.split_outer * self.split_inner


def flex_layout(shape: Sequence[int], split_axis: int, concat_axis: int, itemsize: int, ranks: int) -> FlexLayout:
    """The layout of ``all_to_all_flex(x, split_axis, concat_axis)`` for an input
    of `shape` and `itemsize` bytes per element on `ranks` ranks (docs/algorithms.md)."""
    shape = [int(n) for n in shape]
    if not 0 <= split_axis < len(shape) or not 0 <= concat_axis < len(shape):
        raise ValueError(f"split_axis {split_axis} and concat_axis {concat_axis} must be axes of shape {shape}")
    if shape[split_axis] % ranks:
        raise ValueError(f"shape[{split_axis}] = {shape[split_axis]} is not divisible by the {ranks} ranks")
    chunk = list(shape)
    chunk[split_axis] //= ranks
    return FlexLayout(math.prod(shape[:split_axis]), math.prod(chunk[split_axis:]) * itemsize,
                      math.prod(chunk[:concat_axis]), math.prod(chunk[concat_axis:]) * itemsize)


def flex_path(topology: Topology, layout: FlexLayout, algo: str) -> str:
    """The path ``choose_flex_path`` takes (without an A2A_FLEX_PATH override)."""
    chunk = layout.chunk_bytes
    if chunk == 0 or (layout.split_outer <= 1 and layout.concat_outer <= 1):
        return "contiguous"
    if algo != "linear":
        return "packed"
    piece = min(layout.split_inner, layout.concat_inner)
    if piece >= MIN_PIECE_BYTES and chunk // piece <= MAX_PIECES_PER_PEER:
        return "pieces"
    if topology.transport == "mpi" and chunk >= MIN_DATATYPE_CHUNK_BYTES:
        return "datatypes"
    return "packed"


def predict_flex(topology: Topology, algo: str, layout: FlexLayout, path: str | None = None) -> Prediction:
    """``a2a.all_to_all_flex`` with `layout` (see :func:`flex_layout`), on the path
    the library would take (or `path`: "contiguous", "pieces", "datatypes", "packed").

    The datatypes path is modelled as the linear exchange plus a copy of each strided
    side (MPI packs and unpacks an ``hvector`` through its own buffers)."""
    _check_algo(algo)
    path = flex_path(topology, layout, algo) if path is None else path
    top, chunk, ranks = topology, layout.chunk_bytes, topology.ranks
    size = chunk * ranks
    pack = [_copy_phase(top, "pack", size, layout.split_outer * ranks)] if layout.split_outer > 1 else []
    unpack = [_copy_phase(top, "unpack", size, layout.concat_outer * ranks)] if layout.concat_outer > 1 else []
    if path == "contiguous":
        phases = _uniform_phases(top, algo, chunk)
    elif path == "pieces":
        if algo != "linear":
            raise ValueError("the pieces path is linear only")
        piece = min(layout.split_inner, layout.concat_inner)
        pieces = chunk // piece
        kinds = _uniform_traffic(top, "world", chunk).sends
        traffic = _Traffic.symmetric({kind: (messages * pieces, nbytes) for kind, (messages, nbytes) in kinds.items()})
        phases = [*_check_phases(top, [traffic]), _exchange_phase(top, "exchange", traffic)]
    elif path == "datatypes":
        phases = [*pack, *_uniform_phases(top, "linear", chunk), *unpack]
    elif path == "packed":
        phases = [*pack, *_uniform_phases(top, algo, chunk), *unpack]
    else:
        raise ValueError(f"path must be contiguous, pieces, datatypes or packed, got {path!r}")
    return _prediction(phases, algo, size, ranks)


# ---------------------------------------------------------------------------
# All-to-all-v


def _v_matrix(topology: Topology, counts: Any) -> np.ndarray:
    matrix = np.asarray(counts, dtype=np.int64)
    ranks = topology.ranks
    if matrix.shape != (ranks, ranks):
        raise ValueError(f"counts must be a {ranks} x {ranks} matrix of bytes (send[src][dst]), got shape "
                         f"{matrix.shape}")
    if (matrix < 0).any():
        raise ValueError("counts must not be negative")
    return matrix


def _matrix_traffic(top: Topology, matrix: np.ndarray, kind_of: np.ndarray) -> _Traffic:
    """Per rank and link kind, messages (non-empty blocks) and bytes, sending and receiving."""
    sends, recvs = {}, {}
    for index, kind in enumerate(_KINDS):
        mask = kind_of == index
        if not mask.any():
            continue
        blocks = np.where(mask, matrix, 0)
        sends[kind] = ((blocks > 0).sum(axis=1), blocks.sum(axis=1))
        recvs[kind] = ((blocks > 0).sum(axis=0), blocks.sum(axis=0))
    return _Traffic(sends, recvs)


def _kinds_between(top: Topology, sources: np.ndarray, destinations: np.ndarray) -> np.ndarray:
    """The link kind (an index of _KINDS) of every (source, destination) pair of ranks."""
    local = top.local_size
    same_rank = sources[:, None] == destinations[None, :]
    same_node = (sources[:, None] // local) == (destinations[None, :] // local)
    same_rail = (sources[:, None] % local) == (destinations[None, :] % local)
    return np.where(same_rank, 0, np.where(same_node, 1, np.where(same_rail, 2, 3)))


def predict_v(topology: Topology, algo: str, counts: Any = None, *, size_bytes: int | None = None,
              plan: bool = True) -> Prediction:
    """``a2a.all_to_all_v`` (``plan=True``: the plan's count exchange included,
    as one call makes) or ``plan.run`` of ``a2a.plan_v`` (``plan=False``).

    `counts`: a W x W matrix of bytes, ``counts[src][dst]``; or None with
    `size_bytes`: the even split. Each phase takes as long as its slowest rank."""
    _check_algo(algo)
    top, ranks = topology, topology.ranks
    if counts is None:
        if size_bytes is None:
            raise ValueError("predict_v needs counts or size_bytes")
        chunk = _check_size("size_bytes", size_bytes) // ranks
        phases = _v_plan_phases(top, algo) if plan else []
        phases += _uniform_phases(top, algo, chunk)
        return _prediction(phases, "v" if plan else "v-plan", chunk * ranks, ranks)
    matrix = _v_matrix(top, counts)
    phases = _v_plan_phases(top, algo) if plan else []
    rank_ids = np.arange(ranks)
    if algo == "linear" or not top.two_level:
        exchange = _matrix_traffic(top, matrix, _kinds_between(top, rank_ids, rank_ids))
        phases += [*_check_phases(top, [exchange]), _exchange_phase(top, "exchange", exchange)]
    else:
        nodes, local = top.nodes, top.local_size
        grid = matrix.reshape(nodes, local, nodes, local)  # [n, a, m, b]: bytes (n, a) -> (m, b)
        # Phase 2: (n, a) -> (n, b) the row sum_m size((n, a) -> (m, b)).
        rows_to_local = grid.sum(axis=2)  # [n, a, b]
        intra = np.zeros((ranks, ranks), dtype=np.int64)
        for n in range(nodes):
            intra[n * local:(n + 1) * local, n * local:(n + 1) * local] = rows_to_local[n]
        # Phase 4: (m, l) -> (n, l) the row sum_l'' size((m, l'') -> (n, l)).
        rows_to_node = grid.sum(axis=1)  # [m, n, l]
        inter = np.zeros((ranks, ranks), dtype=np.int64)
        for m in range(nodes):
            for n in range(nodes):
                inter[m * local + rank_ids[:local], n * local + rank_ids[:local]] = rows_to_node[m, n]
        kinds = _kinds_between(top, rank_ids, rank_ids)
        relay = intra.sum(axis=0)  # what each rank received in phase 2 and regroups in phase 3
        intra_traffic, inter_traffic = _matrix_traffic(top, intra, kinds), _matrix_traffic(top, inter, kinds)
        phases += [
            *_check_phases(top, [intra_traffic, inter_traffic]),
            _copy_phase(top, "copy1", matrix.sum(axis=1), ranks),
            _exchange_phase(top, "intra", intra_traffic),
            _copy_phase(top, "copy2", relay, ranks),
            _exchange_phase(top, "inter", inter_traffic),
        ]
    mean = int(matrix.sum() // ranks)
    return _prediction(phases, "v" if plan else "v-plan", mean, ranks)


def _v_plan_phases(top: Topology, algo: str) -> list[Phase]:
    """The plan: a linear exchange of one int64 per peer (carrying the check),
    and for 2DH the intra-node exchange of the relay counts (N int64 per local peer)."""
    phases = _uniform_phases(top, "linear", COUNT_BYTES)
    phases = [p.__class__("counts", p.time_s, p.bytes, p.messages) if p.name == "exchange" else
              p.__class__("counts check", p.time_s, p.bytes, p.messages) for p in phases]
    if algo == "2dh" and top.two_level:
        phases.append(_exchange_phase(top, "relay counts", _uniform_traffic(top, "node", COUNT_BYTES * top.nodes)))
    return phases


# ---------------------------------------------------------------------------
# Where 2DH overtakes linear


def crossover(topology: Topology, size_bytes: int, ranks: Sequence[int]) -> int | None:
    """The smallest of `ranks` (whole nodes of ``topology.local_size``) from which
    2DH is predicted faster than linear at `size_bytes`, at it and at every larger
    one of `ranks`; None when 2DH is not faster at the largest."""
    faster = [(w, predict(topology.with_ranks(w), "2dh", size_bytes).time_s
               < predict(topology.with_ranks(w), "linear", size_bytes).time_s) for w in sorted(ranks)]
    start = None
    for w, wins in faster:
        if wins and start is None:
            start = w
        elif not wins:
            start = None
    return start


def power_of_two_ranks(local_size: int, largest: int) -> list[int]:
    """Two nodes, four, eight... of `local_size` ranks, up to `largest` ranks."""
    out, nodes = [], 2
    while nodes * local_size <= largest:
        out.append(nodes * local_size)
        nodes *= 2
    return out
