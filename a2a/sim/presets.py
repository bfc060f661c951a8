"""The machines users have, as :class:`~a2a.sim.model.Topology` presets, with
where each number comes from (docs/scaling.md has the table).

``a100``: Tutel's testbed (Section 5: Azure ND96amsr_A100_v4, 8 x A100 SXM
80GB per node, 3rd-generation NVLink and NVSwitch, 8 x 200 Gb/s HDR
InfiniBand per node, non-blocking network). ``h100``: the same shape one
generation on (NVLink4, 8 x 400 Gb/s NDR). ``local``: this repository's CPU
host, 2 cores, ranks over Open MPI's shared memory with nodes emulated by
``A2A_LOCAL_SIZE``, fitted to ``tests/data/sim_local_*.json``. ``cluster``,
``cluster-10g``, ``cluster-1g``: the namespace cluster on that host (real
nodes, TCP between them, links unshaped or shaped to 10 or 1 Gbit/s), fitted
to ``tests/data/sim_cluster/``.
"""

from __future__ import annotations

from types import MappingProxyType

from .topology import Topology

__all__ = ["FIT_OUTLIER_SCALE", "FIT_PARAMETERS", "PRESETS", "preset"]

KIB = 1 << 10

_A100 = Topology(
    name="a100",
    nodes=8,
    local_size=8,
    # NVLink3: 12 links x 25 GB/s = 300 GB/s per direction per GPU; NCCL's busbw on an
    # 8 x A100 node reaches about 80% of it.
    intra_bandwidth=240e9,
    intra_latency=8e-6,
    intra_half_message=64 * KIB,
    # HDR: 200 Gb/s = 25 GB/s per NIC; ib_write_bw peaks near 24 GB/s (Tutel Figure 16a).
    nic_bandwidth=24e9,
    nics_per_node=8,
    inter_latency=10e-6,
    # Tutel Figure 16: small messages do not saturate HDR; half the bandwidth at 64 KiB
    # is a fixed cost of 2.7 us per message, NCCL's per-peer cost at scale.
    inter_half_message=64 * KIB,
    # HBM2e 2.0 TB/s; a copy reads and writes every byte, a stride-copy kernel gets ~80%.
    copy_bandwidth=800e9,
    copy_latency=5e-6,
    copy_half_chunk=512,
    cross_rail_factor=1.0,  # non-blocking fat tree with adaptive routing (Azure)
    concurrent=True,
    check="round",
    transport="nccl",
)

_H100 = _A100.replace(
    name="h100",
    # NVLink4: 18 links x 25 GB/s = 450 GB/s per direction, ~80% reached.
    intra_bandwidth=360e9,
    intra_half_message=96 * KIB,  # the same fixed cost per message as a100's in time
    # NDR: 400 Gb/s = 50 GB/s per NIC, ~96% reached.
    nic_bandwidth=48e9,
    inter_half_message=128 * KIB,  # NCCL's per-message cost does not shrink with the link
    # HBM3 3.35 TB/s: ~1.35 TB/s of bytes copied.
    copy_bandwidth=1.35e12,
)

# Fitted by: python -m a2a.sim fit tests/data/sim_local_2x2.json tests/data/sim_local_4x2.json --preset local
# (14 runs of python -m a2a.bench --algo linear,2dh -b 1K -e 16M -f 4 -r 7 --no-baseline, 7 at --np 4
# --local-size 2 and 7 at --np 8 --local-size 2, on a quiet host, 2026-11-28; docs/scaling.md). tests/unit/test_sim.py
# fits them again from elsewhere and checks these numbers. The latencies fitted to nothing (below
# 1e-17 s): the per-message and per-chunk costs carry the fixed costs, so they are 0 and not fitted.
_LOCAL = Topology(
    name="local",
    nodes=2,
    local_size=2,
    intra_bandwidth=7.942e9,
    intra_latency=0.0,
    intra_half_message=1.490e4,
    nic_bandwidth=7.942e9,  # unused: emulated nodes share the host's memory (emulated=True)
    nics_per_node=2,
    inter_latency=0.0,
    inter_half_message=1.490e4,
    copy_bandwidth=2.652e10,
    copy_latency=0.0,
    copy_half_chunk=1.133e4,
    concurrent=False,
    emulated=True,
    cores=2,
    sharing_exponent=1.154,
    cache_bytes=1.148e8,
    copy_memory_bandwidth=6.006e9,
    in_band_cost=0.03913,  # the cluster's fit (its rows have the check on and off; these only on)
    check="in_band",
    transport="mpi",
)

# The namespace cluster (a2a.cluster, issue 25): nodes are network namespaces on this host, ranks of a node
# talk over Open MPI's shared memory, ranks of different nodes over TCP through veth pairs and a bridge; every
# rank shares the host's 2 cores and its cache. Shared memory's per-message cost and the copies are the host's,
# as `local` measured them (intra_half_message, copy_bandwidth, copy_half_chunk, cache_bytes: `local`'s, kept
# below, as are its zero latencies, cores, check and transport); the rest is the
# fit of the sweep's 2x2, 2x4, 4x2 and 4x4 runs at every link rate (a row's rate is its own, `link`):
#   python -m a2a.sim fit tests/data/sim_cluster/*_{2x2,2x4,4x2,4x4}.json --preset cluster
# (docs/scaling.md; tests/unit/test_sim_cluster.py fits them again and checks these numbers, and the
# predictions of the 8x2 and 8x4 runs). cluster-10g and cluster-1g are the same with the link shaped.
_CLUSTER = _LOCAL.replace(
    name="cluster",
    intra_bandwidth=1.200e10,
    nic_bandwidth=1.524e9,  # TCP through the kernel, per rank: CPU time, not a NIC (one_host=True)
    nics_per_node=1,
    inter_latency=7.123e-06,
    inter_half_message=9383.0,
    emulated=False,
    one_host=True,
    sharing_exponent=1.076,
    copy_memory_bandwidth=4.261e9,
    in_band_cost=0.02339,
    link_efficiency=0.9241,
)
_CLUSTER_10G = _CLUSTER.replace(name="cluster-10g", link_rate=10e9 / 8)  # tc's rate; the payload's: link_efficiency
_CLUSTER_1G = _CLUSTER.replace(name="cluster-1g", link_rate=1e9 / 8)

PRESETS = MappingProxyType({t.name: t for t in (_A100, _H100, _LOCAL, _CLUSTER, _CLUSTER_10G, _CLUSTER_1G)})
"""name -> Topology (at a default shape; :meth:`Topology.with_ranks` changes it)."""

# The parameters `fit` fits by default, per preset: the ones the preset's measurements can tell.
_CLUSTER_FITTED = ("intra_bandwidth", "nic_bandwidth", "inter_latency", "inter_half_message",
                   "copy_memory_bandwidth", "sharing_exponent", "in_band_cost", "link_efficiency")
FIT_PARAMETERS = MappingProxyType({
    "local": ("intra_bandwidth", "intra_half_message", "copy_bandwidth", "copy_half_chunk", "sharing_exponent",
              "cache_bytes", "copy_memory_bandwidth"),
    "a100": ("intra_bandwidth", "intra_latency", "intra_half_message", "nic_bandwidth", "inter_latency",
             "inter_half_message", "copy_bandwidth", "copy_latency"),
    "h100": ("intra_bandwidth", "intra_latency", "intra_half_message", "nic_bandwidth", "inter_latency",
             "inter_half_message", "copy_bandwidth", "copy_latency"),
    **dict.fromkeys(("cluster", "cluster-10g", "cluster-1g"), _CLUSTER_FITTED),
})

# The loss `fit` uses by default, per preset (fit's outlier_scale; absent: plain least squares). The cluster's
# runs share 2 cores with everything else on the host, and a run of one shape can come out 2-4x slower than
# another run of it (docs/scaling.md): a soft-L1 loss keeps such rows from pulling the whole fit.
FIT_OUTLIER_SCALE = MappingProxyType(dict.fromkeys(("cluster", "cluster-10g", "cluster-1g"), 0.2))


def preset(name: str, ranks: int | None = None, local_size: int | None = None) -> Topology:
    """The preset `name`, at `ranks` ranks of `local_size` per node when given."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}")
    topology = PRESETS[name]
    if ranks is not None or local_size is not None:
        topology = topology.with_ranks(ranks if ranks is not None else topology.ranks, local_size)
    return topology
