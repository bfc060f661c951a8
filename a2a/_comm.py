"""a2a.Comm: a communicator over an mpi4py communicator."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _C


class Comm:
    """A communicator for the a2a collectives.

    Attributes: ``rank``, ``size``, ``local_rank``, ``local_size``, ``node``,
    ``num_nodes``. Nodes are blocks of ``local_size`` consecutive ranks
    (``rank = node * local_size + local_rank``); 2DH needs them to be equal.

    Create it with :meth:`from_mpi`. The MPI communicator is duplicated, so the
    collectives never interfere with the caller's own messages.
    """

    def __init__(self, native: Any, mpi_comm: Any):
        self._native = native
        self.mpi_comm = mpi_comm
        (self.rank, self.size, self.local_rank, self.local_size, self.node, self.num_nodes) = native.topology
        self._workspace = np.empty(0, dtype=np.uint8)

    @classmethod
    def from_mpi(
        cls,
        comm: Any = None,
        *,
        local_size: int | None = None,
        timeout_s: float | None = None,
        use_mpi_datatypes: bool | None = None,
    ) -> Comm:
        """Wraps an mpi4py communicator (default ``MPI.COMM_WORLD``). Collective.

        ``local_size`` (ranks per node) overrides the topology from
        ``MPI_Comm_split_type(SHARED)``, as does the environment variable
        ``A2A_LOCAL_SIZE``; use it to emulate ``num_nodes x local_size`` on one
        machine. ``timeout_s`` bounds every wait (default: ``A2A_TIMEOUT_S``,
        else 300 s). ``use_mpi_datatypes=False`` packs strided layouts with
        copies instead of MPI derived datatypes (default: ``A2A_MPI_DATATYPES``,
        else True).
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
        datatypes = -1 if use_mpi_datatypes is None else int(bool(use_mpi_datatypes))
        native = _C.Comm(MPI._addressof(comm), int(local_size or 0), float(timeout_s or 0.0), datatypes)
        return cls(native, comm)

    def workspace(self, nbytes: int) -> tuple[int, int]:
        """(address, size) of a cached host workspace of at least nbytes."""
        if nbytes == 0:
            return 0, 0
        if self._workspace.nbytes < nbytes:
            self._workspace = np.empty(nbytes, dtype=np.uint8)
        return self._workspace.ctypes.data, self._workspace.nbytes

    def __repr__(self) -> str:
        return (
            f"a2a.Comm(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, node={self.node}, num_nodes={self.num_nodes})"
        )
