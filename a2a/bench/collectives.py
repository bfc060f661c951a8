"""An nccl-tests ``alltoall_perf``-compatible benchmark of the a2a collectives
(``python -m a2a.bench`` without ``--op`` or ``--layout``).

    python -m a2a.bench                              # 4 ranks (2 emulated nodes of 2)
    python -m a2a.bench --np 8 -b 1K -e 64M -f 2 --algo all --json out.json
    python -m a2a.bench --local-size 2 --baseline mpi,gloo --plot sweep.png
    mpirun -np 16 python -m a2a.bench -b 8M -e 1G -f 2 -d half

Under mpirun (or srun) it runs on every rank of ``MPI_COMM_WORLD``. Started
plainly it starts itself under mpirun through :mod:`a2a.launch`, on ``--np``
ranks (default 4; with neither ``--np`` nor ``--local-size`` nor
``A2A_LOCAL_SIZE`` given it also emulates 2 ranks per node so that ``2dh``
differs from ``linear``). ``--np 1`` runs in this process.

Flags follow nccl-tests: ``-b/--minbytes``, ``-e/--maxbytes``,
``-f/--stepfactor``, ``-i/--stepbytes``, ``-n/--iters``, ``-w/--warmup_iters``,
``-c/--check``, ``-d/--datatype``, plus ``-r/--repeats`` (sizes take K/M/G suffixes, powers of 1024;
datatypes int8, uint8, int32, int64, half, float, double, bfloat16 (needs
torch) or all).
Added: ``--algo`` (``linear``, ``2dh``, ``flex``, ``v`` or ``all``, or a comma
list), ``--inner-algo`` (the exchange under flex and v), ``--np``,
``--local-size``, ``--json FILE``, ``--plot FILE.png``, ``--baseline LIST``
(``mpi``, ``gloo``, ``d2d`` or ``none``, or a comma list such as
``mpi,gloo``; ``--no-baseline`` is ``--baseline none``),
``--experts-per-rank`` and ``--hidden`` (the flex shape).

What one row reports, column by column: :mod:`a2a.bench.collectives_table`.
The datatypes, sizes, the values sent and their buffers are in
collectives_data.py, the parser in collectives_options.py, the baselines
(and gloo's process group) in collectives_baselines.py; here, the cases,
their timing and check, and the run on every rank.

``--device cuda`` moves torch CUDA tensors (one GPU per rank, by local rank;
one rank by default, where mpirun is not needed) over ``--transport nccl``
(default) or ``mpi`` (staged through page-locked host memory; ranks may share
a GPU). Every timed loop ends in ``torch.cuda.synchronize()``. The baseline
row ``d2d`` is one device-to-device copy of the same bytes, and the last
column becomes ``vs D2D``: on one GPU, the 1-rank exchange against a plain
copy. (The layout kernels alone: ``python -m a2a.bench --layout``.)

Only rank 0 prints. The footer gives nccl-tests' ``Out of bounds values``
(total wrong elements) and ``Avg bus bandwidth`` (mean busbw over all a2a
rows), then the mean busbw of each algorithm and the geometric mean of its
ratios to each baseline. ``--json FILE`` writes every row (baselines
included) as a JSON list; ``--plot FILE.png`` draws busbw against size and
the ratios (:mod:`a2a.bench.plot`; needs matplotlib, checked before the
sweep), with the busbw that the scale model :mod:`a2a.sim` predicts for the
linear and 2dh rows at this run's topology beside them (``--predict PRESET``:
``local``, fitted on this kind of host, by default on cpu; ``none`` by
default on cuda). The exit code is 1 when any element was wrong.

A long sweep shows its progress on one line of stderr when that is a
terminal (the README says where; :func:`a2a.bench.common.forward_output`
counts the rows of a relaunched run); stdout and the JSON never hold it.

``--op encode|decode|permute|unpermute|all`` switches to the MoE kernel
benchmark (one process, no mpirun; :mod:`a2a.bench.kernels`, its own flags:
``python -m a2a.bench --op all --help``), and ``--layout`` to the layout
kernels (:mod:`a2a.bench.layout`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import launch
from . import common, plot
from .collectives_baselines import (
    A2A_OVER_GLOO,
    BASELINE,
    BASELINES,
    D2D_BASELINE,
    GLOO_BASELINE,
    describe,
    resolve_baselines,
    start_gloo,
)
from .collectives_data import (
    DTYPES,
    Arrays,
    DType,
    bandwidths,
    block_values,
    expected_value,
    flex_shape,
    per_peer_count,
    resolve_dtypes,
    sweep_sizes,
)
from .collectives_fp8 import FP8_DATATYPES, fp8_case
from .collectives_options import (
    ALGOS,
    DEFAULT_LOCAL_SIZE,
    DEFAULT_NP,
    PREDICT_PRESETS,
    build_parser,
    check_cluster,
)
from .collectives_table import counters_line, footer_lines, form_lines, format_row, header_lines, nodes_lines

__all__ = [
    "DTYPES",
    "bandwidths",
    "block_values",
    "expected_value",
    "flex_shape",
    "main",
    "per_peer_count",
    "sweep_sizes",
]


def _have_torch() -> bool:
    """Whether torch is installed (without importing it: that takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # a module object without a spec stands in for it
        return False


def _count_wrong(got: np.ndarray, expected_blocks: list[tuple[int, int, int]], modulus: int) -> int:
    """Elements of flat `got` that differ from the concatenated expected blocks."""
    flat = got.reshape(-1)
    wrong = 0
    offset = 0
    for src, dst, n in expected_blocks:
        expected = block_values(src, dst, n, modulus)
        wrong += int(np.count_nonzero(flat[offset : offset + n] != expected))
        offset += n
    if offset != flat.size:  # cannot happen with the shapes built here
        wrong += abs(flat.size - offset)
    return wrong


# ---------------------------------------------------------------------------
# One measured case: a collective on buffers of one size


@dataclass
class Case:
    algo: str
    size: int  # bytes this rank sends (= receives)
    count: int  # elements per peer (mean for v)
    run: Callable[[], None]
    poison: Callable[[], None]
    wrong: Callable[[], int]
    shape: tuple[int, ...] = ()
    synchronize: Callable[[], None] = lambda: None
    apart: bool = False  # timed after the others' turns, not among them (see _measure_group)


def _make_case(algo: str, requested: int, dtype: DType, comm: Any, args: argparse.Namespace) -> Case:
    from mpi4py import MPI

    import a2a

    arrays = Arrays(dtype, args.device)
    world, rank = comm.size, comm.rank
    count = per_peer_count(requested, world, dtype.itemsize)
    mod = dtype.modulus

    if algo in ("flex", "combine"):
        # MoE dispatch, (E, C, M) -> (E/W, W*C, M) with split_axis=0,
        # concat_axis=1; combine, the way back with split_axis=1, concat_axis=0.
        experts, capacity, hidden = flex_shape(count, world, args.experts_per_rank, args.hidden)
        epr = args.experts_per_rank
        block = epr * capacity * hidden
        dispatched_shape = (epr, world * capacity, hidden)
        by_destination = arrays.empty((world, epr, capacity, hidden))
        arrays.fill_blocks(by_destination, [(rank, dst, block) for dst in range(world)])
        if algo == "flex":
            send, recv, split, concat = by_destination.reshape(experts, capacity, hidden), arrays.empty(dispatched_shape), 0, 1
        else:
            send = arrays.swap_first_axes(by_destination).reshape(dispatched_shape)
            recv, split, concat = arrays.empty((experts, capacity, hidden)), 1, 0

        def run() -> None:
            a2a.all_to_all_flex(send, comm=comm, split_axis=split, concat_axis=concat, algo=args.inner_algo, out=recv)

        def wrong() -> int:
            got = arrays.comparable(recv)
            if algo == "flex":  # recv[e, s*C + c, m] is element (e, c, m) of the block from rank s
                got = np.ascontiguousarray(got.reshape(epr, world, capacity, hidden).transpose(1, 0, 2, 3))
            return _count_wrong(got, [(src, rank, block) for src in range(world)], mod)

        return Case(
            algo,
            world * block * dtype.itemsize,
            block,
            run,
            lambda: arrays.poison(recv),
            wrong,
            tuple(send.shape),
            arrays.synchronize,
        )

    if algo == "fp8":
        run, poison, wrong, block, shape = fp8_case(count, dtype, comm, args)
        return Case(algo, world * block * dtype.itemsize, block, run, poison, wrong, shape, arrays.synchronize)

    if algo in ("v", "v-plan"):
        counts = common.v_counts(world, count)
        send_counts = counts[rank]
        recv_expected = [counts[src][rank] for src in range(world)]
        send = arrays.empty((sum(send_counts),))
        recv = arrays.empty((sum(recv_expected),))
        arrays.fill_blocks(send, [(rank, dst, n) for dst, n in enumerate(send_counts)])
        got_counts: list[Any] = [None]

        if algo == "v-plan":
            # Counts exchanged once, here; every timed call moves only data.
            plan = a2a.plan_v(send_counts, like=send, comm=comm, algo=args.inner_algo)

            def run() -> None:
                plan.run(send, out=recv)
                got_counts[0] = plan.recv_counts

        else:

            def run() -> None:
                got_counts[0] = a2a.all_to_all_v(send, send_counts, comm=comm, algo=args.inner_algo, out=recv)[1]

        def poison() -> None:
            arrays.poison(recv)
            got_counts[0] = None

        def wrong() -> int:
            # A wrong recv_count counts as one wrong element (if the call did
            # not run at all, the poisoned elements already say so).
            got = [] if got_counts[0] is None else [int(c) for c in got_counts[0]]
            bad_counts = sum(int(a != b) for a, b in zip(got, recv_expected)) + (len(got) not in (0, world))
            blocks = [(src, rank, n) for src, n in enumerate(recv_expected)]
            return bad_counts + _count_wrong(arrays.comparable(recv), blocks, mod)

        shape = (sum(send_counts),)
        return Case(algo, world * count * dtype.itemsize, count, run, poison, wrong, shape, arrays.synchronize)

    # linear, 2dh, the MPI and gloo baselines: the 1-D layout of MPI_Alltoall.
    send = arrays.empty((world * count,))
    recv = arrays.empty((world * count,))
    arrays.fill_blocks(send, [(rank, dst, count) for dst in range(world)])
    if algo == BASELINE:
        mpi_type = getattr(MPI, dtype.mpi_type)
        per = dtype.itemsize // mpi_type.Get_size()
        send_raw, recv_raw = arrays.raw(send), arrays.raw(recv)
        msg = (send_raw, count * per, mpi_type)
        rmsg = (recv_raw, count * per, mpi_type)

        def run() -> None:
            MPI.COMM_WORLD.Alltoall(msg, rmsg)

    elif algo == GLOO_BASELINE:
        # The process group start_gloo made; the tensors share the buffers'
        # memory, so the check below reads what gloo wrote.
        import torch.distributed as dist

        send_tensor, recv_tensor = arrays.tensor(send), arrays.tensor(recv)

        def run() -> None:
            dist.all_to_all_single(recv_tensor, send_tensor)

    elif algo == A2A_OVER_GLOO:
        def run() -> None:
            a2a.all_to_all(send, comm=args.gloo_comm, algo="linear", out=recv)

    elif algo == D2D_BASELINE:
        # The same bytes as one device-to-device copy: what a GPU exchange
        # (or layout kernel) is measured against. Only the local block
        # lands where all_to_all puts it, so #wrong is not defined.
        def run() -> None:
            recv.copy_(send)

    else:

        def run() -> None:
            a2a.all_to_all(send, comm=comm, algo=algo, out=recv)

    def wrong() -> int:
        if algo == D2D_BASELINE:
            return 0 if np.array_equal(arrays.comparable(recv), arrays.comparable(send)) else world * count
        return _count_wrong(arrays.comparable(recv), [(src, rank, count) for src in range(world)], mod)

    shape = (world * count,)
    return Case(
        algo, world * count * dtype.itemsize, count, run, lambda: arrays.poison(recv), wrong, shape, arrays.synchronize,
        apart=algo in (GLOO_BASELINE, A2A_OVER_GLOO),
    )


def _time(case: Case, args: argparse.Namespace) -> float:
    """Seconds per call: the average of -n back-to-back calls, max over ranks."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    case.synchronize()
    world.Barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        case.run()
    case.synchronize()  # CUDA: the calls only enqueued their work
    elapsed = (time.perf_counter() - start) / args.iters
    return world.allreduce(elapsed, op=MPI.MAX)


def _measure_group(cases: list[Case], args: argparse.Namespace) -> list[float]:
    """Median seconds per call of each case over -r repetitions in which the
    cases take turns; the cases timed `apart` come after those turns, their
    -r repetitions back to back.

    gloo is timed apart: its calls sleep in the kernel while they wait, and
    whichever case followed it in a turn paid for waking the ranks up (on 4
    ranks over 2 cores, linear right after gloo measured 0.44x
    MPI_Alltoall's algbw at 1 KiB; with gloo timed apart 0.63x, as in a run
    without gloo)."""
    turns = [case for case in cases if not case.apart]
    for case in turns:
        for _ in range(args.warmup_iters):
            case.run()
    samples = dict(zip(map(id, turns), common.take_turns([lambda case=case: _time(case, args) for case in turns],
                                                          args.repeats)))
    for case in cases:
        if case.apart:
            for _ in range(args.warmup_iters):
                case.run()
            samples[id(case)] = [_time(case, args) for _ in range(args.repeats)]
    return [statistics.median(samples[id(case)]) for case in cases]


def _check(case: Case, args: argparse.Namespace) -> int | None:
    """Wrong elements summed over ranks, or None with -c 0."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if args.check <= 0:
        return None
    wrong = 0
    for _ in range(args.check):
        case.poison()
        case.synchronize()
        world.Barrier()  # nobody's data arrives before every receive buffer is poisoned
        case.run()
        case.synchronize()
        wrong += case.wrong()
    return world.allreduce(wrong, op=MPI.SUM)


def predicted_curves(rows: list[dict], preset: str, ranks: int, local_size: int) -> list[plot.Prediction]:
    """(algo, size, busbw in GB/s) that `preset` of a2a.sim predicts for the
    linear and 2dh rows of a sweep (the other forms need their layouts)."""
    from .. import sim

    topology = sim.preset(preset, ranks=ranks, local_size=local_size)
    points = {(row["algo"], row["size"]) for row in rows if not row["baseline"] and row["algo"] in ("linear", "2dh")}
    return [(algo, size, sim.predict(topology, algo, size).busbw / 1e9) for algo, size in sorted(points) if size]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stepfactor is None:
        args.stepfactor = 1.0 if args.stepbytes is not None else 4.0
    if args.stepbytes is None:
        args.stepbytes = 1 << 20
    algos: list[str] = []
    for name in (s.strip().lower() for s in args.algo.split(",")):
        picked = list(ALGOS) if name == "all" else [name]
        if name != "all" and name not in ALGOS:
            parser.error(f"--algo: unknown algorithm {name!r}; expected {', '.join(ALGOS)} or all")
        algos += [a for a in picked if a not in algos and not (name == "all" and a == "fp8")]
    args.algos = algos
    try:
        args.dtypes = resolve_dtypes(args.datatype, have_torch=_have_torch())
        args.sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as error:
        parser.error(str(error))
    if "fp8" in algos and any(d.name not in FP8_DATATYPES for d in args.dtypes):
        parser.error(f"--algo fp8 quantizes floats: -d must be of {', '.join(FP8_DATATYPES)}")
    common.require_at_least(parser, (
        ("-n/--iters", args.iters, 1),
        ("-r/--repeats", args.repeats, 1),
        ("-w/--warmup_iters", args.warmup_iters, 0),
        ("-c/--check", args.check, 0),
        ("--experts-per-rank", args.experts_per_rank, 1),
        ("--hidden", args.hidden, 1),
    ))
    if args.np is not None and args.np < 1:
        parser.error(f"--np must be positive, got {args.np}")
    if args.transport is not None and args.device != "cuda":
        parser.error("--transport chooses how CUDA buffers move: it needs --device cuda")
    if args.device == "cuda" and args.transport is None:
        args.transport = "nccl"
    try:
        args.baselines = resolve_baselines(args.baseline, device=args.device, no_baseline=args.no_baseline,
                                           have_torch=_have_torch())
    except ValueError as error:
        parser.error(str(error))
    # The ratio columns: one per baseline; with none, the default's column stays (all "-").
    args.ratio_columns = args.baselines or [D2D_BASELINE if args.device == "cuda" else BASELINE]
    if args.plot:
        missing = plot.matplotlib_missing()
        if missing is not None:  # refused now, not after the sweep
            parser.error(missing)
    if args.predict is None:
        args.predict = "none" if args.device == "cuda" else "local"
    if args.predict not in ("none", *PREDICT_PRESETS):
        parser.error(f"--predict: unknown preset {args.predict!r}; expected {', '.join(PREDICT_PRESETS)} or none")
    check_cluster(parser, args)
    if args.local_size is not None:
        if args.local_size < 1:
            parser.error(f"--local-size must be positive, got {args.local_size}")
        if args.np is not None and args.np % args.local_size:
            parser.error(f"--np {args.np} is not divisible by --local-size {args.local_size}")
    return args


def main(argv: list[str]) -> int:
    """The sweep: relaunched under mpirun when not under it already (and more
    than one rank is asked for), else run on every rank of MPI_COMM_WORLD."""
    args = parse_args(argv)
    # One GPU is the CUDA default: a 1-rank run needs no mpirun.
    default_np = 1 if args.device == "cuda" else DEFAULT_NP
    if args.cluster is not None and not launch.under_mpirun():
        return common.relaunch_on_cluster("a2a.bench", argv, *args.cluster, args.rate)
    if not launch.under_mpirun() and (args.np if args.np is not None else default_np) > 1:
        return common.relaunch("a2a.bench", argv, args.np, args.local_size, default_np=DEFAULT_NP,
                               default_local_size=DEFAULT_LOCAL_SIZE, progress=_progress(args))
    return common.on_every_rank(lambda: _bench(args, argv))


# ---------------------------------------------------------------------------
# The benchmark itself (every rank)


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from mpi4py import MPI

    import a2a

    world = MPI.COMM_WORLD
    device_text = "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("a2a.bench: --device cuda needs a CUDA device (torch.cuda.is_available() is False)")
        comm = common.cuda_comm(world, local_size=args.local_size, transport=args.transport)
        device_text = f"cuda:{torch.cuda.current_device()}"
    else:
        comm = a2a.Comm.from_mpi(world, local_size=args.local_size)
    if GLOO_BASELINE not in args.baselines:
        return _sweep(args, argv, world, comm, device_text)
    stop_gloo = start_gloo(world, args)
    code = _sweep(args, argv, world, comm, device_text)
    stop_gloo()  # on an exception main() aborts the job instead
    return code


def _sweep(args: argparse.Namespace, argv: list[str], world: Any, comm: Any, device_text: str) -> int:

    rank, nranks = comm.rank, comm.size
    lead = rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    ranks_info = world.gather((os.getpid(), socket.gethostname(), comm.node, comm.local_rank, device_text), root=0)
    command = common.command_line(argv)
    if lead and args.np is not None and args.np != nranks:
        print(f"# note: --np {args.np} ignored: running on the {nranks} ranks of mpirun", flush=True)

    say(
        f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} "
        + (f"step: {args.stepfactor:g}(factor)" if args.stepfactor > 1 else f"step: {args.stepbytes}(bytes)")
        + f" warmup iters: {args.warmup_iters} iters: {args.iters} agg iters: 1 validation: {args.check} graph: 0"
    )
    say("#")
    say("# Using devices")
    if lead:
        for r, (pid, host, node, local_rank, where) in enumerate(ranks_info):
            print(
                f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host:>10s} device {where:>4s} node {node} "
                f"local_rank {local_rank}"
            )
    say("#")
    link = os.environ.get(common.LINK_ENV) if args.cluster is not None else None
    for line in nodes_lines(args, comm, link):
        say(line)
    if "2dh" in args.algos and (comm.num_nodes == 1 or comm.local_size == 1):
        say("# note: with one node or one rank per node, 2dh runs the linear exchange")
    say(f"# algorithms: {' '.join(args.algos)}; flex and v over {args.inner_algo}")
    if not comm.cross_check:
        say("# cross-rank check off (A2A_CROSS_CHECK=0): no call checks that every rank called it alike")
    if args.datatype.strip().lower() == "all" and "bfloat16" not in [d.name for d in args.dtypes]:
        say("# note: -d all skips bfloat16: torch is not installed")
    for line in form_lines(args, nranks):
        say(line)
    if args.device == "cuda":
        say(f"# device: CUDA ({common.gpu_name()}), transport {comm.transport}; calls are timed to a torch.cuda.synchronize()")
    for base in args.baselines:
        say(f"# baseline: {describe(base)}")
    if A2A_OVER_GLOO in args.algos:
        say(f"# {describe(A2A_OVER_GLOO)}")
    say("# time: max over ranks of the mean over -n calls; busbw = algbw * (ranks-1)/ranks; GB = 1e9 B")
    say("#")

    rows: list[dict] = []
    # What every row of the run records besides its measurement (inner_algo: flex and v only).
    run = {"ranks": nranks, "local_size": comm.local_size, "num_nodes": comm.num_nodes, "inner_algo": None}
    run.update(device=args.device, transport=comm.transport, iters=args.iters, repeats=args.repeats)
    run.update(warmup_iters=args.warmup_iters, command=command, timestamp=common.utc_timestamp())
    run.update(link=link)  # the namespace cluster's link rate ("unshaped"), None off it
    run.update(cross_check=comm.cross_check)
    for line in header_lines(args.ratio_columns):
        say(line)
    algos = args.baselines + args.algos
    progress = _progress(args, enabled=lead)
    for dtype in args.dtypes:
        for requested in args.sizes:
            progress.show(len(rows))
            cases = [_make_case(algo, requested, dtype, comm, args) for algo in algos]
            group = [
                _row(case, requested, dtype, seconds, _check(case, args), nranks)
                for case, seconds in zip(cases, _measure_group(cases, args))
            ]
            for case, row in zip(cases, group):
                if args.counters and not row["baseline"]:
                    row["counters"] = common.per_call_counters(case.run, case.synchronize)
            del cases  # frees the buffers before the next size
            base_algbw = {row["algo"]: row["algbw"] for row in group if row["baseline"]}
            for row in group:
                # algbw ratios equal busbw ratios (same ranks), and exist on one rank too.
                row["ratios"] = {} if row["baseline"] else {
                    base: row["algbw"] / algbw for base, algbw in base_algbw.items() if algbw
                }
                row["baseline_algbws"] = dict(base_algbw)
                # The first baseline's, as the table's first ratio column.
                row["baseline_algbw"] = base_algbw.get(args.baselines[0]) if args.baselines else None
                row["ratio"] = row["ratios"].get(args.baselines[0]) if args.baselines else None
                row.update(run)
                if row["algo"] in ("flex", "combine", "fp8", "v", "v-plan"):
                    row["inner_algo"] = args.inner_algo
            progress.clear()  # the rows go to stdout, maybe the same terminal
            # a2a rows first, then the baselines they are compared with.
            for row in [r for r in group if not r["baseline"]] + [r for r in group if r["baseline"]]:
                say(format_row(row, args.ratio_columns))
                rows.append(row)
            for row in (r for r in group if "counters" in r):
                say(counters_line(row))
    for line in footer_lines(rows, args.algos, args.ratio_columns):
        say(line)
    total_wrong = sum(r["wrong"] or 0 for r in rows)
    if lead and args.json:
        common.write_json(args.json, rows)
    if lead and args.plot:
        predicted = None
        if args.predict != "none":
            predicted = predicted_curves(rows, args.predict, comm.size, comm.local_size)
        plot.plot_sweep(rows, args.plot, predicted)
    return 1 if total_wrong else 0


def _progress(args: argparse.Namespace, enabled: bool = True) -> common.Progress:
    """The progress line of this sweep: a group of rows per datatype and size, in the order they run."""
    groups = [f"{dtype.name} {common.size_text(size)}" for dtype in args.dtypes for size in args.sizes]
    return common.Progress(groups, len(args.baselines) + len(args.algos), label="a2a.bench", enabled=enabled)


def _row(case: Case, requested: int, dtype: DType, seconds: float, wrong: int | None, nranks: int) -> dict:
    algbw, busbw = bandwidths(case.size, seconds, nranks)
    return {
        "size": case.size,
        "count": case.count,
        "type": dtype.name,
        "redop": "none",
        "root": -1,
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": wrong,
        "algo": case.algo,
        "baseline": case.algo in BASELINES,
        "requested_size": requested,
        "shape": list(case.shape),
    }
