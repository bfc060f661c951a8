"""a2a.Comm: a communicator over MPI (host or CUDA buffers) or NCCL."""

from __future__ import annotations

import math
import numbers
import os
import socket
import sys
from typing import Any

import numpy as np

from . import _C
from ._arrays import ArrayView, address_of, empty_like
from ._counters import note_allocation

DEVICES = ("cpu", "cuda")
TRANSPORTS = ("mpi", "nccl", "external")  # a2a_transport_t; external: Comm.from_torch on the CPU
MPI_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")  # a2a_mpi_thread_level_t 0..3
_C_INT_MIN, _C_INT_MAX = -(2**31), 2**31 - 1


class Comm:
    """A communicator for the a2a collectives.

    Attributes: ``rank``, ``size``, ``local_rank``, ``local_size``, ``node``,
    ``num_nodes``, ``irregular_reason`` ("" when the nodes are equal blocks of consecutive ranks, else why
    ``algo="2dh"`` refuses the communicator); ``device`` (``"cpu"`` or ``"cuda"``), ``cuda_device`` (the
    CUDA ordinal, None on the CPU) and ``transport`` (``"mpi"``, ``"nccl"``, or ``"external"``: the
    torch.distributed group of :meth:`from_torch` on the CPU);
    ``mpi_thread_level``, the thread support MPI granted the process
    (``"single"``, ``"funneled"``, ``"serialized"`` or ``"multiple"``; None for
    a communicator without MPI).

    Calls on one communicator must not overlap: from a second thread they
    raise ``UnsupportedError``. Calls on different communicators may run in
    threads at once (the collectives release the GIL) when
    ``mpi_thread_level`` is ``"multiple"``; with less, the overlapping call
    raises ``UnsupportedError``.
    Nodes are blocks of ``local_size`` consecutive ranks
    (``rank = node * local_size + local_rank``); 2DH needs them to be equal.

    Create it with :meth:`from_mpi` or :meth:`from_torch`, or from another
    one with :meth:`split`. Every communicator has its own MPI duplicate and
    its own NCCL communicator, so it never interferes with the caller's
    messages or other communicators.

    On a CUDA communicator the collectives take torch CUDA tensors and CuPy
    arrays on its device and run on the framework's current stream: they are
    enqueued and return without waiting (see docs/gpu.md for where a call
    waits). The workspace is cached per communicator; when its calls move to
    another stream, the core orders the new stream after the old one.
    """

    def __init__(self, native: Any, mpi_comm: Any = None, control_group: Any = None, timeout_s: float | None = None):
        self._native = native
        self.mpi_comm = mpi_comm
        # The bound of every wait, as given at creation (None: A2A_TIMEOUT_S, else the default); what
        # split() and host_twin() give the communicators they make.
        self.timeout_s = timeout_s
        # from_torch(device="cuda"): the gloo group beside NCCL that carries the check and host values; else None.
        self.control_group = control_group
        (self.rank, self.size, self.local_rank, self.local_size, self.node, self.num_nodes) = native.topology
        # "" when the nodes are equal blocks of consecutive ranks; else why algo="2dh" refuses this communicator.
        self.irregular_reason: str = native.irregular_reason
        # False: collectives do not check that every rank called them alike (cross_check=False).
        self.cross_check: bool = native.cross_check
        # True: once the calls repeat, a call that every rank predicted posts its check and goes on; the
        # check completes at the next call or at check() (MPI with NCCL; docs/algorithms.md).
        self.predicts_check: bool = native.predicts_check
        device_type, transport, cuda_device = native.device
        self.device = DEVICES[device_type]
        self.transport = TRANSPORTS[transport]
        self.cuda_device = cuda_device if cuda_device >= 0 else None
        level = native.mpi_thread_level
        self.mpi_thread_level = MPI_THREAD_LEVELS[level] if level >= 0 else None
        self._workspace = np.empty(0, dtype=np.uint8)  # host; the fast NumPy path passes it to the core
        self._device_workspaces: dict[str, Any] = {}  # framework -> CUDA buffer
        self._stream = None

    def __copy__(self) -> Comm:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Comm:
        """The communicator itself: a handle on a live communicator, which a copied model shares with
        the original, as torch modules share their process group (copy.deepcopy of a model: an EMA or
        a teacher). A new communicator comes from split() or a from_* call, collectively."""
        return self

    def __reduce__(self):
        raise TypeError("a2a.Comm cannot be pickled: it is a handle on a live communicator of this process; save "
                        "the model's state_dict() and create the communicator again (Comm.from_mpi, from_torch) "
                        "where it is loaded")

    @classmethod
    def from_mpi(
        cls,
        comm: Any = None,
        *,
        device: str = "cpu",
        transport: str | None = None,
        cuda_device: int | None = None,
        local_size: int | None = None,
        timeout_s: float | None = None,
        use_mpi_datatypes: bool | None = None,
        cross_check: bool | None = None,
    ) -> Comm:
        """Wraps an mpi4py communicator (default ``MPI.COMM_WORLD``). Collective.

        ``device="cuda"`` makes the collectives take CUDA buffers, moved by
        ``transport="nccl"`` (the default for CUDA; the NCCL unique id is
        broadcast over MPI) or ``transport="mpi"`` (staged through page-locked
        host memory: for clusters without NCCL, and several ranks sharing one
        GPU, which NCCL refuses). ``cuda_device`` defaults to the current device.

        ``local_size`` (ranks per node) overrides the topology from
        ``MPI_Comm_split_type(SHARED)``, as does the environment variable
        ``A2A_LOCAL_SIZE``; use it to emulate ``num_nodes x local_size`` on one
        machine. ``timeout_s`` bounds every wait (default: ``A2A_TIMEOUT_S``,
        else 300 s). ``use_mpi_datatypes=False`` packs strided layouts with
        copies instead of MPI derived datatypes (default: ``A2A_MPI_DATATYPES``,
        else True; host communicators only). ``cross_check=False`` drops the
        check that every rank called each collective alike (default:
        ``A2A_CROSS_CHECK``, else True): a round of every algorithm but linear,
        whose exchange carries it. Without it, as in MPI and NCCL, ranks that
        disagree time out or exchange garbage. It must be equal on every rank.
        """
        from mpi4py import MPI

        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        if local_size is not None and int(local_size) <= 0:
            raise ValueError(f"local_size must be a positive integer, got {local_size}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if transport is None:
            transport = "nccl" if device == "cuda" else "mpi"
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "nccl" and device != "cuda":
            raise ValueError("transport='nccl' moves CUDA memory: pass device='cuda'")
        datatypes = -1 if use_mpi_datatypes is None else int(bool(use_mpi_datatypes))
        native = _C.Comm(
            MPI._addressof(comm),
            int(local_size or 0),
            _timeout(timeout_s),
            datatypes,
            DEVICES.index(device),
            TRANSPORTS.index(transport),
            -1 if cuda_device is None else int(cuda_device),
            _cross_check(cross_check),
        )
        return cls(native, comm, timeout_s=timeout_s)

    @classmethod
    def from_torch(
        cls,
        group: Any = None,
        *,
        device: str | None = None,
        cuda_device: int | None = None,
        local_size: int | None = None,
        timeout_s: float | None = None,
        cross_check: bool | None = None,
        control_group: Any = None,
    ) -> Comm:
        """A communicator over the ranks of a ``torch.distributed`` group
        (default: the whole world). Collective over the group; works under
        torchrun.

        ``device="cuda"`` (the default where torch sees a GPU, or with
        ``cuda_device``): NCCL. The
        group's first rank creates the NCCL unique id and broadcasts it over
        the group (any backend that can broadcast Python objects).
        ``cuda_device`` defaults to torch's current device. The argument
        check and the host values (all-to-all-v counts, capacities) go over a
        gloo group of the same ranks beside NCCL: ``control_group``, else the
        group itself where it has gloo (``init_process_group()``'s default
        ``cpu:gloo,cuda:nccl``), else for the world a gloo group made once
        for it. A call that every rank predicted then posts its check there
        and enqueues its data at once: no wait for the stream, no round
        (docs/algorithms.md, "The predicted check"). A subgroup with NCCL
        alone and no ``control_group`` checks over NCCL instead, waiting for
        the stream at every call.

        ``device="cpu"`` (the default without a GPU): host tensors moved by
        the group itself (its gloo backend's point-to-point messages,
        a2a/_torch_transport.py). Every algorithm runs over it; the argument
        check is a round of its own. It is the transport of last resort: under
        mpirun, :meth:`from_mpi` (or :meth:`from_job`) moves the same data over
        MPI, 2-40x faster.

        ``local_size``: given, else ``A2A_LOCAL_SIZE``, else for the world
        group ``LOCAL_WORLD_SIZE`` (torchrun) or ``OMPI_COMM_WORLD_LOCAL_SIZE``,
        else counted from the hosts of the group's ranks. ``cross_check``: as
        in :meth:`from_mpi`.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Comm.from_torch needs torch.distributed.init_process_group() first")
        if group is None:
            group = dist.group.WORLD
        if local_size is not None and int(local_size) <= 0:
            raise ValueError(f"local_size must be a positive integer, got {local_size}")
        if device is None:  # a CUDA device named, or one there
            device = "cuda" if cuda_device is not None or torch.cuda.is_available() else "cpu"
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("Comm.from_torch: this process is not a member of the group")
        if device == "cpu":
            return cls._over_torch_group(group, size, rank, local_size, timeout_s, cross_check)
        if cuda_device is None:
            cuda_device = torch.cuda.current_device()
        # Every member makes the same torch.distributed calls whatever fails
        # locally, so that a failure on one rank is raised on all of them.
        first = dist.get_global_rank(group, 0)
        box: list[Any] = [(None, None)]  # (unique id, or the reason there is none)
        if rank == 0:
            try:
                box[0] = (_C.nccl_unique_id(), None)
            except Exception as error:  # noqa: BLE001 - sent to the other ranks, then raised everywhere
                box[0] = (None, f"{type(error).__name__}: {error}")
        dist.broadcast_object_list(box, src=first, group=group, device=_object_device(group, cuda_device))
        local_size = _torch_local_size(group, size, local_size)
        unique_id, problem = box[0]
        if problem is not None:
            raise RuntimeError(f"Comm.from_torch: the group's first rank could not create a NCCL unique id: {problem}")
        control = _control_group(group, control_group)
        transport = None
        if control is not None:
            from ._torch_transport import TorchGroupTransport, agree_tag_base

            transport = TorchGroupTransport(control, agree_tag_base(control))
        native = _C.Comm.from_nccl_id(unique_id, size, rank, local_size, _timeout(timeout_s), int(cuda_device),
                                      _cross_check(cross_check), control=transport,
                                      control_name=transport.backend if transport else "")
        return cls(native, control_group=control, timeout_s=timeout_s)

    @classmethod
    def _over_torch_group(cls, group: Any, size: int, rank: int, local_size: int | None, timeout_s: float | None,
                          cross_check: bool | None, note: bool = True) -> Comm:
        """from_torch(device="cpu"): the group's own messages carry a2a's."""
        import torch.distributed as dist

        from ._torch_transport import TorchGroupTransport, agree_tag_base

        backend = str(dist.get_backend(group)).lower()
        if "gloo" not in backend:
            raise ValueError(f"Comm.from_torch(device='cpu') moves host tensors over the group, whose backend "
                             f"({backend!r}) has no gloo; create the group with backend 'gloo' (or "
                             "'cpu:gloo,cuda:nccl'), or pass device='cuda'")
        transport = TorchGroupTransport(group, agree_tag_base(group))
        local = _torch_local_size(group, size, local_size)
        native = _C.Comm.from_transport(transport, transport.backend, size, rank, int(local or 0),
                                        _timeout(timeout_s), _cross_check(cross_check))
        if size > 1 and note:
            _note_the_slower_transport(rank)
        return cls(native, timeout_s=timeout_s)

    @classmethod
    def from_job(
        cls,
        group: Any = None,
        *,
        device: str = "cpu",
        cuda_device: int | None = None,
        local_size: int | None = None,
        timeout_s: float | None = None,
        cross_check: bool | None = None,
    ) -> Comm:
        """The running job's communicator over `group`'s ranks: a
        ``torch.distributed`` group, or None (torch.distributed's default
        group when it is initialized, else the MPI world). Collective over
        the group.

        ``device="cpu"`` gives MPI: the world, or under mpirun the MPI
        sub-communicator of the group's ranks in group order (so a gloo
        group of an mpirun job runs a2a's collectives over MPI); a group
        started by another launcher (torchrun) gets its own messages
        (``from_torch(group, device="cpu")``, slower than MPI). ``device="cuda"`` gives NCCL: over the group
        (``from_torch``) when torch.distributed is initialized, else over
        the MPI world (``from_mpi``). a2a/_job.py has the whole table.
        ``cross_check``: as in :meth:`from_mpi`.
        """
        from . import _job

        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        options = {"local_size": local_size, "timeout_s": timeout_s, "cross_check": cross_check}
        group = _job.torch_group(group)
        if device == "cuda":
            if group is not None:
                return cls.from_torch(group, cuda_device=cuda_device, **options)
            return cls.from_mpi(device="cuda", cuda_device=cuda_device, **options)
        if group is None:
            return cls.from_mpi(**options)
        if not _job.cpu_over_mpi(group):  # torchrun: no MPI beneath; the group's own messages carry a2a's
            return cls.from_torch(group, device="cpu", **options)
        return cls.from_mpi(_job.mpi_comm_of(group), **options)

    def split(self, color: int | None, key: int | None = None) -> Comm | None:
        """Splits this communicator, like ``MPI_Comm_split``. Collective: every
        rank calls it. The ranks that pass the same ``color`` (an int >= 0)
        form a new :class:`Comm`, ranked by ``(key, rank)``; ``key`` defaults
        to this rank, which keeps the order. ``color=None`` joins no new
        communicator and returns None.

        The new communicator is of this one's kind: the same device and CUDA
        device, transport (its own MPI communicator, split from this one's
        duplicate; its own NCCL communicator, by ``ncclCommSplit``), timeout
        and settings. Its nodes follow this one's: when its ranks on each node
        form one block of consecutive ranks, and the blocks are of equal size,
        ``local_size`` is that size, else 1 (2DH then runs like linear). It
        does not depend on this communicator afterwards: either may be used,
        or dropped, without the other. Its ``mpi_comm`` is None.

        A color or key that is not an int (or a negative color) raises
        ``InvalidArgumentError`` on its rank and ``RemoteError`` on the others,
        and a failure to create the new communicator on any rank raises on
        every rank; no rank then keeps one.
        """
        problem = _split_problem(color, key)
        if problem is not None:
            self._native.report_invalid("split", f"split on rank {self.rank} of {self.size}: {problem}")
        native = self._native.split(
            _C.UNDEFINED if color is None else int(color), self.rank if key is None else int(key)
        )
        return None if native is None else Comm(native, timeout_s=self.timeout_s)

    def host_twin(self) -> Comm:
        """Collective: a communicator over the same ranks, in the same order
        and nodes, for small host values (NumPy rows) with no wait for a
        device. A CUDA communicator with MPI beneath (``from_mpi(device=
        "cuda")``, and the test factory's host model of it, which predicts its
        checks) gets a host one over the same MPI ranks; one from
        ``from_torch`` with a gloo group beside NCCL (``control_group``), a
        host one over that group. A row of host values then crosses the host
        channel alone, instead of a copy to the GPU, an all-gather there and
        a copy back that waits for the stream (two stream syncs, behind all
        the work queued before). Any other communicator is its own twin (NCCL
        alone: host values cross it through the device)."""
        if self.device == "cuda" and self.control_group is not None:
            return Comm._over_torch_group(self.control_group, self.size, self.rank, self.local_size, self.timeout_s,
                                          self.cross_check, note=False)
        if self.mpi_comm is None or (self.device == "cpu" and not self.predicts_check):
            return self
        return Comm.from_mpi(self.mpi_comm, cross_check=self.cross_check, timeout_s=self.timeout_s)

    def check(self) -> None:
        """Completes the cross-rank check of the last call where it was posted
        rather than waited for (``predicts_check``: a communicator of MPI and
        NCCL, once its calls repeat); otherwise does nothing. Where a rank
        left the call that every rank predicted, raises on every rank, as that
        call would have, and the communicator is retired. The next call
        completes it too: call this at the end of a loop. Collective where a
        check is posted."""
        self._native.check()

    def _bind(self, v: ArrayView) -> str | None:
        """Checks that v lives where this communicator moves memory; on CUDA,
        sets the stream of the next collective to v's current stream. Returns
        the reason v cannot be used, or None."""
        if self.device == "cpu":
            if v.cuda_device is not None:
                return (
                    f"input is a {v.framework} array on {v.device_text} but this communicator moves host memory; "
                    "create it with a2a.Comm.from_mpi(..., device='cuda') or Comm.from_torch()"
                )
            return None
        if v.cuda_device != self.cuda_device:
            return (
                f"input is a {v.framework} array on {v.device_text} but this communicator moves memory of "
                f"cuda:{self.cuda_device}"
            )
        self._use_stream(v.stream())
        return None

    def _use_stream(self, stream: int) -> None:
        """The next collective runs on `stream` (a cudaStream_t as an int)."""
        if stream != self._stream:
            self._native.set_stream(stream)
            self._stream = stream

    def workspace(self, nbytes: int, like: ArrayView | None = None) -> tuple[int, int]:
        """(address, size) of a cached workspace of at least nbytes: host
        memory, or CUDA memory allocated with like's framework."""
        if nbytes == 0:
            return 0, 0
        if like is None or like.cuda_device is None:
            if self._workspace.nbytes < nbytes:
                self._workspace = np.empty(nbytes, dtype=np.uint8)
                note_allocation()
            return self._workspace.ctypes.data, self._workspace.nbytes
        buffer = self._device_workspaces.get(like.framework)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = empty_like(like, (nbytes,), "uint8")
            self._device_workspaces[like.framework] = buffer
        return address_of(buffer), int(buffer.nbytes)

    def __repr__(self) -> str:
        where = "cpu" if self.cuda_device is None else f"cuda:{self.cuda_device}"
        return (
            f"a2a.Comm(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, node={self.node}, num_nodes={self.num_nodes}, "
            f"device={where}, transport={self.transport})"
        )


def _split_problem(color: Any, key: Any) -> str | None:
    """Why (color, key) cannot be passed to Comm.split, or None."""
    for name, value in (("color", color), ("key", key)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            wanted = "an int >= 0, or None" if name == "color" else "an int, or None"
            return f"{name} must be {wanted}; got {type(value).__name__} {value!r}"
        if not _C_INT_MIN <= int(value) <= _C_INT_MAX:
            return f"{name} {int(value)} does not fit in a C int"
    if color is not None and int(color) < 0:
        return f"color {int(color)} is negative; pass an int >= 0, or None for a rank that joins no new communicator"
    return None


# (world group, the gloo group made beside it for the world's NCCL communicators): made once per world, and
# made again for a new world after destroy_process_group() and init_process_group().
_world_gloo: list[tuple[Any, Any]] = []


def _control_group(group: Any, given: Any) -> Any:
    """The gloo group beside a NCCL communicator over `group` (from_torch):
    `given`, else `group` where it has gloo, else one made for the world
    (collective over the world, which is then the group), else None."""
    import torch.distributed as dist

    def has_gloo(candidate: Any) -> bool:
        return "gloo" in str(dist.get_backend(candidate)).lower()

    if given is not None:
        ranks, control_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(given)
        if not has_gloo(given) or control_ranks != ranks:
            raise ValueError(f"Comm.from_torch: control_group must be a gloo group of the group's ranks {ranks} in "
                             f"that order, got backend {dist.get_backend(given)!r} over ranks {control_ranks}")
        return given
    if has_gloo(group):
        return group
    if group is dist.group.WORLD:
        if not _world_gloo or _world_gloo[0][0] is not group:
            _world_gloo[:] = [(group, dist.new_group(backend="gloo"))]
        return _world_gloo[0][1]
    return None


def _object_device(group: Any, cuda_device: int) -> Any:
    """Where broadcast_object_list stages the pickled id: the GPU for NCCL
    groups, the host otherwise."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", cuda_device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


_NOTED: list[bool] = []


def _note_the_slower_transport(rank: int) -> None:
    """Says once per job (rank 0 of the first such communicator) that MPI
    would be faster: the choice is the launcher's, made before any call.
    Under mpirun the caller chose this transport over MPI: nothing to say."""
    from .launch import under_mpirun

    if _NOTED or rank != 0 or os.environ.get("A2A_QUIET") or under_mpirun():
        return
    _NOTED.append(True)
    print("a2a: CPU collectives over torch.distributed (gloo), since no MPI is beneath this job; MPI moves the same "
          "data 2-40x faster: launch with mpirun (python -m a2a.launch --np N -- ...) to use it "
          "(A2A_QUIET=1 hides this line)", file=sys.stderr, flush=True)


def _torch_local_size(group: Any, size: int, given: int | None) -> int:
    """The local_size to pass to the core: `given`; 0 (the core reads
    A2A_LOCAL_SIZE, or for the world group LOCAL_WORLD_SIZE /
    OMPI_COMM_WORLD_LOCAL_SIZE, and checks them across ranks); else the
    ranks per host when hosts are equal blocks of consecutive group ranks,
    1 otherwise (2DH then runs as the linear algorithm). Every member
    gathers the hosts, so no rank waits for another that decided otherwise."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if given is not None:
        return int(given)
    if os.environ.get("A2A_LOCAL_SIZE"):
        return 0
    if size == dist.get_world_size() and any(os.environ.get(n) for n in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        return 0
    per_host = hosts.count(hosts[0])
    blocks = [hosts[i : i + per_host] for i in range(0, size, per_host)]
    regular = size % per_host == 0 and all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == len(blocks)
    return per_host if regular else 1


def _timeout(value: float | None) -> float:
    """The core's timeout setting: 0 (A2A_TIMEOUT_S, else its default) for None, else seconds > 0."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"timeout_s must be None (A2A_TIMEOUT_S, else the default) or a number of seconds > 0, "
                         f"got {value!r}")
    return float(value)


def _cross_check(value: bool | None) -> int:
    """The core's cross_check setting: -1 (A2A_CROSS_CHECK, else on), 1 or 0."""
    if value is None:
        return -1
    if not isinstance(value, bool):
        raise TypeError(f"cross_check must be True, False or None, got {value!r}")
    return int(value)
