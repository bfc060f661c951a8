"""A machine and the shape of a job on it: the :class:`Topology` that
:mod:`a2a.sim.model` predicts on, its parameters and which of them
:func:`a2a.sim.fit` can fit. Units: seconds, bytes, bytes per second."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKS", "FITTABLE", "Topology"]

CHECKS = ("none", "in_band", "round")


@dataclass(frozen=True)
class Topology:
    """A machine and the shape of the job on it. Units: seconds, bytes, bytes per second.

    Links (each direction, what one rank gets):

    * intra-node: ``intra_bandwidth`` per rank (NVLink / NVSwitch), latency
      ``intra_latency`` per phase, ``intra_half_message``: the message size
      that moves at half the bandwidth.
    * inter-node: ``nics_per_node`` NICs of ``nic_bandwidth`` shared by the
      node's ``local_size`` ranks, ``inter_latency``, ``inter_half_message``.
      ``cross_rail_factor``: the bandwidth of a message between different
      local ranks of two nodes (another rail) relative to one on the same rail;
      1 on a non-blocking fat tree, less where rails meet only at an
      oversubscribed spine.
    * local copies: ``copy_bandwidth`` (bytes copied per second),
      ``copy_latency`` per call (a kernel launch, the thread pool's dispatch),
      ``copy_half_chunk``: the chunk size that copies at half the bandwidth.

    How a phase adds up: ``concurrent`` links (GPUs: NVLink, the NICs and the
    copy engine work at once) take the longest of the phase's parts; otherwise
    (one CPU per rank drives every message and copy) their sum.
    ``emulated``: the nodes are emulated on one host (``A2A_LOCAL_SIZE``), so
    every message, across an emulated node too, uses the intra-node link, and
    all ranks share the host's ``cores``: every phase takes ``max(1, W / cores) **
    sharing_exponent`` times as long (busy-polling ranks time-sliced on too few
    cores lose more than their share: the exponent is fitted).
    ``one_host``: real nodes that all run on one host (the namespace cluster,
    ``a2a.cluster``): the ranks share ``cores`` and the cache as emulated ones
    do, but a message to another node takes the inter-node link (TCP), whose
    cost is the sending and receiving ranks' CPU time: ``nic_bandwidth`` per
    rank (not a NIC shared by the node's ranks), shared like the rest.
    ``link_rate`` > 0 (bytes per second; 0: not shaped): each node's link is
    shaped to this rate each way (``tc tbf`` on both ends of its veth), of
    which TCP's payload gets ``link_efficiency`` (headers, the other way's
    acknowledgements, TCP through a token bucket). That is time on the wire,
    not on the cores: an exchange takes the longer of its CPU time (shared)
    and its busiest node's bytes in or out over the payload's rate.
    ``cache_bytes`` > 0 (CPU hosts): a copy whose bytes, read and written by
    every rank of the host, do not fit in this much cache runs partly at
    ``copy_memory_bandwidth``: the fraction ``cache / (cache + working set)``
    of its bytes at ``copy_bandwidth``, the rest at ``copy_memory_bandwidth``.
    ``check``: how the argument check runs: ``"in_band"`` (MPI communicators:
    in every exchange of the call, costing ``in_band_cost`` times their CPU
    time), ``"round"``
    (NCCL: an allgather of the signatures over the host, ``ceil(log2 W)``
    latencies), ``"none"`` (not this library: nccl-tests' own all-to-all, as
    in Tutel's figures). ``transport``: ``"mpi"`` or ``"nccl"`` (whether the
    flex datatypes path exists).
    """

    name: str
    nodes: int
    local_size: int
    intra_bandwidth: float
    intra_latency: float
    intra_half_message: float
    nic_bandwidth: float
    nics_per_node: int
    inter_latency: float
    inter_half_message: float
    copy_bandwidth: float
    copy_latency: float
    copy_half_chunk: float
    cross_rail_factor: float = 1.0
    concurrent: bool = True
    emulated: bool = False
    cores: int = 0
    sharing_exponent: float = 1.0
    cache_bytes: float = 0.0
    copy_memory_bandwidth: float = 0.0
    one_host: bool = False
    link_rate: float = 0.0
    link_efficiency: float = 1.0
    in_band_cost: float = 1.0
    check: str = "round"
    transport: str = "nccl"

    def __post_init__(self) -> None:
        for field in ("nodes", "local_size", "nics_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology {self.name}: {field} must be an int >= 1, got {value!r}")
        for field in FITTABLE:
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Topology {self.name}: {field} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.link_rate, (int, float)) and math.isfinite(self.link_rate) and self.link_rate >= 0):
            raise ValueError(f"Topology {self.name}: link_rate must be a finite number >= 0 (0: not shaped), got "
                             f"{self.link_rate!r}")
        for field in ("intra_bandwidth", "nic_bandwidth", "copy_bandwidth", "cross_rail_factor", "link_efficiency"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Topology {self.name}: {field} must be > 0, got {getattr(self, field)!r}")
        if self.check not in CHECKS:
            raise ValueError(f"Topology {self.name}: check must be one of {CHECKS}, got {self.check!r}")
        if self.transport not in ("mpi", "nccl"):
            raise ValueError(f"Topology {self.name}: transport must be 'mpi' or 'nccl', got {self.transport!r}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 0:
            raise ValueError(f"Topology {self.name}: cores must be an int >= 0 (0: not shared), got {self.cores!r}")
        if self.emulated and self.one_host:
            raise ValueError(f"Topology {self.name}: emulated nodes (one link for every message) and one_host "
                             "(an inter-node link between nodes of one host) exclude each other")

    @property
    def ranks(self) -> int:
        return self.nodes * self.local_size

    @property
    def two_level(self) -> bool:
        """Whether 2DH differs from linear (more than one node and more than one rank per node)."""
        return self.nodes > 1 and self.local_size > 1

    def with_ranks(self, ranks: int, local_size: int | None = None) -> Topology:
        """The same machine with `ranks` ranks, `local_size` (default: this one's) per node."""
        local = self.local_size if local_size is None else local_size
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1 or ranks % local:
            raise ValueError(f"ranks must be a positive multiple of the {local} ranks per node, got {ranks!r}")
        return dataclasses.replace(self, nodes=ranks // local, local_size=local)

    def replace(self, **changes: Any) -> Topology:
        return dataclasses.replace(self, **changes)

    def parameters(self) -> dict[str, Any]:
        """Every field, JSON-able (what ``fit --out`` writes and ``--params`` reads)."""
        return dataclasses.asdict(self)


FITTABLE = (
    "intra_bandwidth", "intra_latency", "intra_half_message",
    "nic_bandwidth", "inter_latency", "inter_half_message",
    "copy_bandwidth", "copy_latency", "copy_half_chunk",
    "cross_rail_factor", "sharing_exponent", "cache_bytes", "copy_memory_bandwidth",
    "link_efficiency", "in_band_cost",
)
"""The numeric parameters, the ones :func:`a2a.sim.fit` can fit."""
