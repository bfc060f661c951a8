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

A sweep that runs longer than a couple of seconds shows how far it got on
one line of stderr, rewritten in place (``[a2a.bench] 12/40 rows, float
64M, 8 s``), when stderr is a terminal: in the process that relaunched
itself under mpirun, which passes the ranks' stdout on and counts its rows
(:func:`a2a.bench.common.forward_output`), or in rank 0 when it runs
alone. Under a plain ``mpirun`` there is none: Open MPI gives the ranks a
pipe for stderr and holds back a line until its newline. The line is
erased before each row is printed and at the end, so stdout and the JSON
never contain it.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import launch
from . import common, plot

PREDICT_PRESETS = ("local", "a100", "h100")  # a2a.sim's presets (tests check they stay the same)

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

DEFAULT_NP = 4
DEFAULT_LOCAL_SIZE = 2  # with the embedded --np default only: 2 emulated nodes of 2 ranks
ALGOS = ("linear", "2dh", "flex", "combine", "v", "v-plan")
BASELINE = "mpi"  # MPI_Alltoall on host buffers
GLOO_BASELINE = "gloo"  # torch.distributed.all_to_all_single over gloo, on CPU tensors
D2D_BASELINE = "d2d"  # --device cuda: a device-to-device copy of the same bytes
BASELINES = (BASELINE, GLOO_BASELINE, D2D_BASELINE)
HOST_BASELINES = (BASELINE, GLOO_BASELINE)  # --device cpu


# ---------------------------------------------------------------------------
# Data types


@dataclass(frozen=True)
class DType:
    """A datatype as nccl-tests names it, and how the benchmark fills it."""

    name: str  # nccl-tests' name, printed in the `type` column
    storage: str  # NumPy dtype name; "bfloat16" lives in torch tensors
    itemsize: int
    # Values are integers in [0, modulus), exact in the dtype; `modulus`
    # itself is the poison written before a validation call.
    modulus: int
    mpi_type: str  # mpi4py datatype moving the same bytes

    @property
    def needs_torch(self) -> bool:
        return self.storage == "bfloat16"

    @property
    def fill_storage(self) -> str:
        """The NumPy dtype that carries fill values into a torch tensor."""
        return "float32" if self.needs_torch else self.storage


_BIG_PRIME = 16_777_213  # largest prime below 2**24: exact in float32
DTYPES = {
    d.name: d
    for d in (
        DType("int8", "int8", 1, 127, "INT8_T"),
        DType("uint8", "uint8", 1, 251, "UINT8_T"),
        DType("int32", "int32", 4, _BIG_PRIME, "INT32_T"),
        DType("int64", "int64", 8, _BIG_PRIME, "INT64_T"),
        DType("half", "float16", 2, 2039, "INT16_T"),  # integers up to 2048 are exact
        DType("float", "float32", 4, _BIG_PRIME, "FLOAT"),
        DType("double", "float64", 8, _BIG_PRIME, "DOUBLE"),
        DType("bfloat16", "bfloat16", 2, 251, "INT16_T"),  # integers up to 256 are exact
    )
}
_DTYPE_ALIASES = {
    "char": "int8",
    "int": "int32",
    "float16": "half",
    "fp16": "half",
    "float32": "float",
    "fp32": "float",
    "float64": "double",
    "fp64": "double",
    "bf16": "bfloat16",
}
_UNSUPPORTED_DTYPES = ("uint32", "uint64", "fp8_e4m3", "fp8_e5m2")


def resolve_dtypes(text: str, *, have_torch: bool) -> list[DType]:
    """The datatypes named by -d (a name, an alias, or "all"). Raises ValueError."""
    key = text.strip().lower()
    if key == "all":
        return [d for d in DTYPES.values() if have_torch or not d.needs_torch]
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        hint = " (a2a does not support it)" if key in _UNSUPPORTED_DTYPES else ""
        raise ValueError(f"unknown datatype {text!r}{hint}; expected one of {', '.join(DTYPES)} or all")
    dtype = DTYPES[key]
    if dtype.needs_torch and not have_torch:
        raise ValueError(
            "-d bfloat16 needs torch (NumPy has no bfloat16; a2a takes bfloat16 torch tensors): pip install torch"
        )
    return [dtype]


def _have_torch() -> bool:
    """Whether torch is installed (without importing it: that takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # a module object without a spec stands in for it
        return False


# ---------------------------------------------------------------------------
# Sizes and bandwidth (pure functions; unit tested)


def sweep_sizes(minbytes: int, maxbytes: int, stepfactor: float = 1, stepbytes: int = 1 << 20) -> list[int]:
    """Requested sizes, as nccl-tests' loop: multiply by stepfactor when it is
    above 1, else add stepbytes, from minbytes while not above maxbytes."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor > 1 and minbytes == 0 and maxbytes > 0:
        raise ValueError("minbytes must be positive with a step factor above 1")
    if stepfactor <= 1 and stepbytes <= 0 and maxbytes > minbytes:
        raise ValueError("stepbytes must be positive when the step factor is 1")
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = int(size * stepfactor) if stepfactor > 1 else size + stepbytes
        if nxt <= size:  # minbytes == maxbytes == 0, or a factor too small to move an integer
            if size == maxbytes:
                break
            nxt = size + 1
        size = nxt
    return sizes


def per_peer_count(nbytes: int, nranks: int, itemsize: int) -> int:
    """Elements sent to each peer for a requested per-rank size (rounded down)."""
    return nbytes // itemsize // nranks


def bandwidths(nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes): algbw = bytes / time, busbw = algbw * (n - 1) / n."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = nbytes / 1.0e9 / seconds
    return algbw, algbw * (nranks - 1) / nranks


def flex_shape(count: int, nranks: int, experts_per_rank: int, hidden: int) -> tuple[int, int, int]:
    """(E, C, M) for all_to_all_flex dispatch holding at most nranks * count
    elements: E = nranks * experts_per_rank experts, M = hidden (less when
    the size is small), C = the capacity that fills the rest."""
    experts = nranks * experts_per_rank
    per_expert = count // experts_per_rank
    m = max(1, min(hidden, per_expert))
    return experts, per_expert // m, m


def expected_value(src: int, dst: int, index: int, modulus: int) -> int:
    """Element `index` of the block rank `src` sends to rank `dst` (pure Python reference).

    The slope 2*src+1 differs between sources, so a block from the wrong
    rank, or shifted, does not match; values stay below `modulus`, so they
    are exact in every dtype."""
    return (index * (2 * src + 1) + 7 * src + 3 * dst) % modulus


def block_values(src: int, dst: int, n: int, modulus: int, start: int = 0) -> np.ndarray:
    """expected_value for indices [start, start + n), as an int64 array."""
    index = np.arange(start, start + n, dtype=np.int64)
    return (index * (2 * src + 1) + (7 * src + 3 * dst)) % modulus


# ---------------------------------------------------------------------------
# Buffers: NumPy, or torch for bfloat16


class _Arrays:
    """Creates, fills and reads buffers of one DType."""

    def __init__(self, dtype: DType, device: str = "cpu"):
        self.dtype = dtype
        self.device = device
        if dtype.needs_torch or device == "cuda":  # CUDA buffers are torch tensors
            import torch

            self._torch = torch
        else:
            self._torch = None
            self._np_dtype = np.dtype(dtype.storage)

    def empty(self, shape: tuple[int, ...]) -> Any:
        if self._torch is not None:
            return self._torch.empty(shape, dtype=getattr(self._torch, self.dtype.storage), device=self.device)
        return np.empty(shape, dtype=self._np_dtype)

    def fill_blocks(self, out: Any, blocks: list[tuple[int, int, int]]) -> None:
        """Writes block_values(src, dst, n) for each (src, dst, n), one after the other, into flat `out`."""
        flat = out.reshape(-1)
        offset = 0
        for src, dst, n in blocks:
            values = block_values(src, dst, n, self.dtype.modulus)
            if self._torch is not None:
                flat[offset : offset + n] = self._torch.from_numpy(values.astype(self.dtype.fill_storage))
            else:
                flat[offset : offset + n] = values
            offset += n

    def poison(self, out: Any) -> None:
        if self._torch is not None:
            out.fill_(float(self.dtype.modulus))
        else:
            out.fill(self.dtype.modulus)

    def comparable(self, x: Any) -> np.ndarray:
        """A NumPy array whose values compare equal to block_values where x is right."""
        if self._torch is not None:
            x = x.cpu()
            return x.float().numpy() if self.dtype.needs_torch else x.numpy()
        return x

    def raw(self, x: Any) -> np.ndarray:
        """NumPy view of the bytes of x (for mpi4py)."""
        if self._torch is not None:
            return x.view(self._torch.int16).numpy()
        return x

    def tensor(self, x: Any) -> Any:
        """A torch tensor sharing x's memory (for torch.distributed)."""
        import torch

        return x if torch.is_tensor(x) else torch.from_numpy(x)

    def swap_first_axes(self, x: Any) -> Any:
        """A C-contiguous copy of x with its first two axes swapped."""
        if self._torch is not None:
            return x.transpose(0, 1).contiguous()
        return np.ascontiguousarray(x.swapaxes(0, 1))

    def synchronize(self) -> None:
        """Waits for the GPU (CUDA calls return before the data moved)."""
        if self.device == "cuda":
            self._torch.cuda.synchronize()


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

    arrays = _Arrays(dtype, args.device)
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
        # The process group _start_gloo made; the tensors share the buffers'
        # memory, so the check below reads what gloo wrote.
        import torch.distributed as dist

        send_tensor, recv_tensor = arrays.tensor(send), arrays.tensor(recv)

        def run() -> None:
            dist.all_to_all_single(recv_tensor, send_tensor)

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
        apart=algo == GLOO_BASELINE,
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


# ---------------------------------------------------------------------------
# Output


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


# ---------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2a.bench",
        description="nccl-tests alltoall_perf-compatible sweep of the a2a all-to-all collectives, "
        "with an MPI_Alltoall baseline (and, with --baseline mpi,gloo, torch.distributed gloo) measured in the same run.",
        epilog="--op encode|decode|permute|unpermute|all benchmarks the MoE kernels instead, in this process "
        "(see python -m a2a.bench --op all --help); --layout the layout kernels (--layout --help).",
        allow_abbrev=False,
    )
    for flag, name, default, which in (("-b", "--minbytes", "1K", "smallest"), ("-e", "--maxbytes", "64M", "largest")):
        help_text = f"{which} size per rank (default {default})"
        p.add_argument(flag, name, type=common.parse_size, default=common.parse_size(default), help=help_text)
    p.add_argument(
        "-f", "--stepfactor", type=float, default=None, help="multiply the size by this (default 4)"
    )
    p.add_argument(
        "-i", "--stepbytes", type=common.parse_size, default=None, help="add this to the size (used when -f is 1)"
    )
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument(
        "-r", "--repeats", type=int, default=5, help="timed repetitions of -n calls; rows show the median (default 5)"
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument(
        "-c", "--check", type=int, default=1, help="validation rounds per row; 0 disables (default 1)"
    )
    p.add_argument("-d", "--datatype", default="float", help=f"{', '.join(DTYPES)} or all (default float)")
    p.add_argument("--algo", default="all", help="linear, 2dh, flex, combine, v, v-plan, all, or a comma list (default all)")
    p.add_argument(
        "--inner-algo",
        choices=("linear", "2dh"),
        default="linear",
        help="the algorithm flex and v run on (default linear)",
    )
    p.add_argument(
        "--np",
        type=int,
        default=None,
        help=f"ranks to launch under mpirun when not under it (default {DEFAULT_NP})",
    )
    p.add_argument("--local-size", type=int, default=None, help="emulated ranks per node (A2A_LOCAL_SIZE)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="flex: experts per rank (default 2)")
    p.add_argument(
        "--hidden", type=int, default=1024, help="flex: model dim M (default 1024; less for small sizes)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: host buffers over MPI; cuda: torch CUDA tensors, one GPU per rank (local_rank %% GPUs), "
        "1 rank by default, baseline a device-to-device copy (default cpu)",
    )
    p.add_argument(
        "--transport",
        choices=("nccl", "mpi"),
        default=None,
        help="--device cuda: nccl (default) or mpi (staged through host memory; ranks may share a GPU)",
    )
    p.add_argument(
        "--baseline",
        metavar="LIST",
        default=None,
        help="baselines measured in the same run, a comma list: mpi (MPI_Alltoall, the cpu default), gloo "
        "(torch.distributed all_to_all_single over gloo on CPU tensors; needs torch), d2d (a device-to-device "
        "copy, the cuda default), or none. One ratio column per baseline, in the order given",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline rows (the same as --baseline none)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE (rank 0)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"draw busbw against size per algorithm and baseline, and the ratios, to FILE.png (rank 0; needs "
        f"matplotlib: {plot.INSTALL_HINT})",
    )
    p.add_argument(
        "--predict",
        metavar="PRESET",
        default=None,
        help="the scale model (a2a.sim) preset whose predicted busbw of linear and 2dh is drawn beside the "
        "measured lines in --plot, at this run's ranks and ranks per node: local, a100, h100, or none "
        "(default: local on cpu, none on cuda, which has no fitted preset for its GPU)",
    )
    return p


def predicted_curves(rows: list[dict], preset: str, ranks: int, local_size: int) -> list[plot.Prediction]:
    """(algo, size, busbw in GB/s) that `preset` of a2a.sim predicts for the
    linear and 2dh rows of a sweep (the other forms need their layouts)."""
    from .. import sim

    topology = sim.preset(preset, ranks=ranks, local_size=local_size)
    points = {(row["algo"], row["size"]) for row in rows if not row["baseline"] and row["algo"] in ("linear", "2dh")}
    return [(algo, size, sim.predict(topology, algo, size).busbw / 1e9) for algo, size in sorted(points) if size]


def resolve_baselines(text: str | None, *, device: str, no_baseline: bool, have_torch: bool) -> list[str]:
    """The baselines of --baseline (a comma list, or none), checked against
    the device. Raises ValueError."""
    default = D2D_BASELINE if device == "cuda" else BASELINE
    if text is None:
        return [] if no_baseline else [default]
    names: list[str] = []
    for name in (part.strip().lower() for part in text.split(",")):
        if name not in (*BASELINES, "none"):
            raise ValueError(f"--baseline: unknown baseline {name!r}; expected mpi, gloo, d2d or none, or a comma list")
        if name not in names:
            names.append(name)
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--baseline: none cannot be combined with {', '.join(n for n in names if n != 'none')}")
        return []
    if no_baseline:
        raise ValueError(f"--no-baseline contradicts --baseline {text}")
    allowed = (D2D_BASELINE,) if device == "cuda" else HOST_BASELINES
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"--baseline {name} does not apply to --device {device}: "
                + ("a device-to-device copy needs --device cuda" if name == D2D_BASELINE
                   else "it moves host buffers; --device cuda compares with d2d")
            )
    if GLOO_BASELINE in names and not have_torch:
        raise ValueError("--baseline gloo needs torch (torch.distributed's gloo backend): pip install torch "
                         "(or pip install 'a2a[torch]')")
    return names


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
            parser.error(f"--algo: unknown algorithm {name!r}; expected linear, 2dh, flex, combine, v, v-plan or all")
        algos += [a for a in picked if a not in algos]
    args.algos = algos
    try:
        args.dtypes = resolve_dtypes(args.datatype, have_torch=_have_torch())
        args.sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as error:
        parser.error(str(error))
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
    stop_gloo = _start_gloo(world)
    code = _sweep(args, argv, world, comm, device_text)
    stop_gloo()  # on an exception main() aborts the job instead
    return code


def _sweep(args: argparse.Namespace, argv: list[str], world: Any, comm: Any, device_text: str) -> int:
    import a2a

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
    emulated = (
        " (emulated with A2A_LOCAL_SIZE / --local-size)"
        if (args.local_size or os.environ.get("A2A_LOCAL_SIZE"))
        else ""
    )
    say(
        f"# a2a {a2a.__version__}: {nranks} ranks = {comm.num_nodes} node(s) x {comm.local_size} ranks{emulated}"
    )
    if "2dh" in args.algos and (comm.num_nodes == 1 or comm.local_size == 1):
        say("# note: with one node or one rank per node, 2dh runs the linear exchange")
    say(f"# algorithms: {' '.join(args.algos)}; flex and v over {args.inner_algo}")
    if args.datatype.strip().lower() == "all" and "bfloat16" not in [d.name for d in args.dtypes]:
        say("# note: -d all skips bfloat16: torch is not installed")
    if "flex" in args.algos:
        say(
            f"# flex: (E, C, M) = ({nranks}*{args.experts_per_rank}, C, min({args.hidden}, size)) "
            "split_axis=0 concat_axis=1; size rounded down to whole shapes"
        )
    if "combine" in args.algos:
        say("# combine: the way back, (E/W, W*C, M) split_axis=1 concat_axis=0")
    if "v" in args.algos or "v-plan" in args.algos:
        say("# v: per-peer counts vary with (rank+peer) % ranks, every rank sends and receives `size` bytes")
    if "v-plan" in args.algos:
        say("# v-plan: the same counts through a2a.plan_v once, then plan.run per call (no count exchange)")
    if args.device == "cuda":
        say(f"# device: CUDA ({_gpu_name()}), transport {comm.transport}; calls are timed to a torch.cuda.synchronize()")
    for base in args.baselines:
        say(f"# baseline: {_baseline_description(base)}")
    say("# time: max over ranks of the mean over -n calls; busbw = algbw * (ranks-1)/ranks; GB = 1e9 B")
    say("#")

    rows: list[dict] = []
    # What every row of the run records besides its measurement (inner_algo: flex and v only).
    run = {"ranks": nranks, "local_size": comm.local_size, "num_nodes": comm.num_nodes, "inner_algo": None}
    run.update(device=args.device, transport=comm.transport, iters=args.iters, repeats=args.repeats)
    run.update(warmup_iters=args.warmup_iters, command=command, timestamp=common.utc_timestamp())
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
                if row["algo"] in ("flex", "combine", "v", "v-plan"):
                    row["inner_algo"] = args.inner_algo
            progress.clear()  # the rows go to stdout, maybe the same terminal
            # a2a rows first, then the baselines they are compared with.
            for row in [r for r in group if not r["baseline"]] + [r for r in group if r["baseline"]]:
                say(format_row(row, args.ratio_columns))
                rows.append(row)
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


def _baseline_description(baseline: str) -> str:
    if baseline == D2D_BASELINE:
        return "d2d = one device-to-device copy of the same bytes (torch copy_); vs D2D = algbw / its algbw"
    if baseline == GLOO_BASELINE:
        import torch

        return f"gloo = torch {torch.__version__} distributed.all_to_all_single over gloo, on CPU tensors"
    return f"mpi = MPI_Alltoall via mpi4py {_mpi4py_version()} on {_mpi_library()}"


def _start_gloo(world: Any) -> Callable[[], None]:
    """torch.distributed over gloo on the ranks of `world` (rank and size
    from MPI). Rank 0 opens the rendezvous store (MASTER_ADDR / MASTER_PORT
    if set, else its host name and a free port) and tells the others where
    it is over MPI. Every wait is bounded by A2A_TIMEOUT_S. Returns the
    teardown, which joins gloo's threads."""
    import datetime

    import torch.distributed as dist

    rank, size = world.Get_rank(), world.Get_size()
    if not dist.is_available() or not dist.is_gloo_available():
        raise SystemExit("a2a.bench: --baseline gloo needs torch.distributed with the gloo backend, "
                         "which this torch build lacks")
    timeout = datetime.timedelta(seconds=_timeout_s())
    store, where = None, None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        try:
            store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT", "0")), size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            where = (host, store.port, None)
        except Exception as error:  # noqa: BLE001 - sent to the other ranks, then raised everywhere
            where = (host, None, f"{type(error).__name__}: {error}")
    host, port, problem = world.bcast(where, root=0)
    if problem is not None:
        raise RuntimeError(f"a2a.bench: --baseline gloo: rank 0 could not open a TCPStore on {host}: {problem}")
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    return dist.destroy_process_group


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


def _timeout_s() -> float:
    """A2A_TIMEOUT_S, else a2a's default of 300 s."""
    text = os.environ.get("A2A_TIMEOUT_S")
    try:
        value = float(text) if text else 300.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"a2a.bench: A2A_TIMEOUT_S={text!r} is not a positive number of seconds")
    return value


def _mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _mpi4py_version() -> str:
    import mpi4py

    return mpi4py.__version__

