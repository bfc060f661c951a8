"""The table of the collectives sweep, in nccl-tests' columns.

What one row reports (out-of-place only; in-place is not supported):

* ``size``: bytes each rank sends, which is also what it receives. As in
  nccl-tests the requested size is rounded down to a multiple of
  ``ranks * itemsize`` (and for flex to whole ``(E, C, M)`` shapes); the
  column shows the size actually moved.
* ``count``: elements sent to each peer, as nccl-tests' alltoall prints it
  (``size / itemsize / ranks``); for ``v`` it is the mean over peers.
* ``time``: after ``-w`` untimed warm-up calls, each rank times ``-n``
  back-to-back calls (after a barrier) with ``time.perf_counter`` and divides
  by ``-n``; the maximum of that average over the ranks is one sample. The
  row shows the median of ``-r`` samples, in microseconds; the algorithms and
  the MPI baseline of one size take turns within each repetition, so the
  ratios compare like with like (nccl-tests averages over ranks instead; the
  maximum is the more conservative figure).
* ``algbw = size / time`` and ``busbw = algbw * (ranks - 1) / ranks``, in
  GB/s with GB = 1e9 bytes (nccl-tests' ``AlltoAllGetBw``).
* ``#wrong``: after timing, each of ``-c`` validation rounds fills the
  receive buffer with a value the data never takes, runs one more call, and
  counts the elements that differ from the expected result, which every rank
  computes locally from the deterministic send pattern (:func:`block_values`),
  without communication; the column is the sum over ranks (``N/A`` with
  ``-c 0``).
* ``algo``: ``linear`` / ``2dh``: :func:`a2a.all_to_all` on a 1-D buffer.
  ``flex``: :func:`a2a.all_to_all_flex` on the MoE dispatch shape
  ``(E, C, M)`` with ``E = ranks * experts_per_rank``, ``split_axis=0``,
  ``concat_axis=1``; ``combine`` the way back, ``(E/W, W*C, M)`` with
  ``split_axis=1``, ``concat_axis=0``. ``v``: :func:`a2a.all_to_all_v` with uneven per-peer
  counts that vary with ``(rank + peer) % ranks`` (from 1/3 to 5/3 of the
  mean on 4 ranks, wider on more; see :func:`v_counts`), so that every rank
  still sends and receives exactly ``size`` bytes; its time includes the
  exchange of the counts that the call does; ``v-plan`` runs the same
  counts through one :func:`a2a.plan_v` made before timing. On one node, or with one rank
  per node, 2dh is the linear exchange (the header says so).
  ``mpi``: the default baseline, ``MPI_Alltoall`` through mpi4py on NumPy
  buffers (for half and bfloat16 as 16-bit integers: the same bytes),
  measured the same way in the same run, taking turns with the a2a rows of
  the same size. ``gloo`` (``--baseline gloo``): ``torch.distributed.
  all_to_all_single`` over the gloo backend, on CPU tensors that share the
  same buffers (same sizes, dtype, warm-up, iterations and check), timed
  after the turns of the others rather than among them (waking up from
  gloo's sleeping waits would be charged to the next case); the
  process group is made in the same mpirun, rank and size from MPI, the
  rendezvous store on rank 0 (``MASTER_ADDR`` / ``MASTER_PORT`` if set,
  else its host name and a free port), its waits bounded by
  ``A2A_TIMEOUT_S``. It needs torch, and says so before anything runs.
* ``vs MPI`` / ``vs gloo``: algbw of the row divided by the algbw of that
  baseline's row of the same size (the same as the busbw ratio: both rows
  have the same ranks); one column per baseline, in ``--baseline``'s order.
  The JSON keeps them all in ``ratios`` (``{"mpi": .., "gloo": ..}``, with
  the baselines' algbw in ``baseline_algbws``); ``ratio`` and
  ``baseline_algbw`` are the first baseline's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import common
from .collectives_baselines import BASELINE, D2D_BASELINE, GLOO_BASELINE

__all__ = ["baseline_label", "counters_line", "footer_lines", "format_row", "header_lines", "nodes_lines"]

# nccl-tests' columns, then algo, then one ratio column per baseline.
_COLUMNS = "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>6}"
_RATIO_COLUMN = "  {:>7}"
_BASELINE_LABELS = {BASELINE: "vs MPI", GLOO_BASELINE: "vs gloo", D2D_BASELINE: "vs D2D"}


def baseline_label(baseline: str) -> str:
    return _BASELINE_LABELS[baseline]


def _columns(baselines: Sequence[str]) -> str:
    return _COLUMNS + _RATIO_COLUMN * len(baselines)


def header_lines(baselines: Sequence[str] = (BASELINE,)) -> list[str]:
    """The table's header, one ratio column per baseline in `baselines`."""
    def line(*cells: str) -> str:
        return "#" + _columns(baselines).format(*cells)[1:]

    names = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "algo")
    units = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "")
    return [
        "#" + " " * 61 + "out-of-place",
        line(*names, *(baseline_label(b) for b in baselines)),
        line(*units, *("(algbw)" for _ in baselines)),
    ]


def format_row(row: dict, baselines: Sequence[str] = (BASELINE,)) -> str:
    """One line of the table; `row["ratios"]` gives the ratio column of each baseline."""
    wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
    ratios = [row["ratios"].get(b) for b in baselines]
    return _columns(baselines).format(
        row["size"],
        row["count"],
        row["type"],
        row["redop"],
        row["root"],
        common.format_time(row["time_us"]),
        f"{row['algbw']:6.2f}",
        f"{row['busbw']:6.2f}",
        wrong,
        row["algo"],
        *("-" if ratio is None else f"{ratio:.2f}x" for ratio in ratios),
    )


def counters_line(row: dict) -> str:
    """--counters: what one call of the row's case costs (a2a.Counters per call, rank 0's)."""
    c = row["counters"]

    def n(value: float) -> str:
        return f"{value:.3g}"

    return (f"#   {row['algo']} per call: data {n(c['data_rounds'])} round(s) {n(c['data_messages'])} message(s), "
            f"control {n(c['control_rounds'])} round(s) {n(c['control_messages'])} message(s), check "
            f"{n(c['check_rounds'])} round(s), host waits {n(c['host_waits'])}, device ops {n(c['kernel_calls'])}, "
            f"allocations {n(c['allocations'])}, native calls {n(c['calls'])}")


def footer_lines(rows: list[dict], algos: list[str], baselines: Sequence[str] = (BASELINE,)) -> list[str]:
    ours = [r for r in rows if not r["baseline"]]
    wrong = sum(r["wrong"] or 0 for r in rows)
    avg = sum(r["busbw"] for r in ours) / len(ours) if ours else 0.0
    lines = [
        common.out_of_bounds_line(wrong),
        f"# Avg bus bandwidth    : {avg:g} ",
        "#",
    ]
    for algo in [*algos, *baselines]:
        mine = [r for r in rows if r["algo"] == algo]
        if not mine:
            continue
        mean = sum(r["busbw"] for r in mine) / len(mine)
        vs = []
        for base in baselines:
            ratio = common.geomean([r["ratios"].get(base) for r in mine])
            if ratio:
                vs.append(f"{baseline_label(base)}: {ratio:.2f}x" if vs else
                          f"{baseline_label(base)} (geomean of ratios): {ratio:.2f}x")
        lines.append(f"#   {algo:<7} avg busbw {mean:8.3f} GB/s" + ("   " + ", ".join(vs) if vs else ""))
    lines.append("#")
    return lines


def nodes_lines(args: Any, comm: Any, link: str | None) -> list[str]:
    """The header's line on the ranks and their nodes: emulated (A2A_LOCAL_SIZE), detected, or
    on the namespace cluster (`link`: its links' rate), with a note when the cluster's shape is
    not what --cluster asked."""
    import a2a

    how = ""
    if link is not None:
        how = f" (namespace cluster: TCP between nodes, links {link})"
    elif args.local_size or os.environ.get("A2A_LOCAL_SIZE"):
        how = " (emulated with A2A_LOCAL_SIZE / --local-size)"
    lines = [f"# a2a {a2a.__version__}: {comm.size} ranks = {comm.num_nodes} node(s) x {comm.local_size} ranks{how}"]
    if link is not None and (comm.num_nodes, comm.local_size) != tuple(args.cluster):
        lines.append(f"# note: --cluster {args.cluster[0]}x{args.cluster[1]} asked, but the ranks see "
                     f"{comm.num_nodes} node(s) x {comm.local_size}")
    return lines


def form_lines(args: Any, nranks: int) -> list[str]:
    """The header's lines that say what each form beyond linear and 2dh moves."""
    algos, lines = args.algos, []
    if "flex" in algos:
        lines.append(f"# flex: (E, C, M) = ({nranks}*{args.experts_per_rank}, C, min({args.hidden}, size)) "
                     "split_axis=0 concat_axis=1; size rounded down to whole shapes")
    if "combine" in algos:
        lines.append("# combine: the way back, (E/W, W*C, M) split_axis=1 concat_axis=0")
    if "fp8" in algos:
        lines.append("# fp8: flex's tokens as an FP8 pair (e4m3, block 128, quantized outside the timing); size "
                     "counts the tokens in the datatype")
    if "v" in algos or "v-plan" in algos:
        lines.append("# v: per-peer counts vary with (rank+peer) % ranks, every rank sends and receives `size` bytes")
    if "v-plan" in algos:
        lines.append("# v-plan: the same counts through a2a.plan_v once, then plan.run per call (no count exchange)")
    return lines
