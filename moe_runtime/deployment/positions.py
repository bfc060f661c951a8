"""Where each logical expert sits (the Deployment paper's placement, Section
VII): ``MoELayer.place`` moves whole experts between ranks.

Logical expert e sits at physical position ``positions[e] = rank * n +
slot``, the same table on every rank. The gate keeps logical ids; the
layer maps its choices through the table before dispatch, and
``gather_experts`` maps the physical layout back to logical order, so the
layer's function is unchanged by a move.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import a2a

from ..experts.relocation import Moved, agree_on_move, move_experts
from .placement import as_assignment

__all__ = ["ExpertPositions"]


class ExpertPositions:
    """The layer's position table (identity until the first move)."""

    def __init__(self, num_experts: int, world: int):
        self.positions = np.arange(num_experts, dtype=np.int64)
        self.world = world
        self._table: torch.Tensor | None = None  # positions as a tensor, None for the identity
        # The table on each device it served: copied once, not on every call (a copy from pageable host
        # memory waits for the stream, which a CUDA graph's capture forbids; common/graphs.py).
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @property
    def placement(self) -> np.ndarray:
        """(W, n) int64: the logical experts each rank holds, slot by slot."""
        by_position = np.empty_like(self.positions)
        by_position[self.positions] = np.arange(self.positions.size)
        return by_position.reshape(self.world, -1)

    @property
    def moved(self) -> bool:
        return self._table is not None

    def physical(self, indices: torch.Tensor) -> torch.Tensor:
        """The gate's logical choices as physical positions."""
        if self._table is None:
            return indices
        table = self._on_device.get(indices.device)
        if table is None:
            table = self._on_device[indices.device] = self._table.to(indices.device)
        return table[indices]

    def logical(self, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole experts in physical order (gather_experts) reordered by logical expert."""
        if self._table is None:
            return whole
        positions = torch.from_numpy(self.positions)
        return {name: tensor.index_select(0, positions.to(tensor.device)) for name, tensor in whole.items()}

    def place(self, assignment: Any, experts: torch.nn.Module, comm: a2a.Comm,
              optimizer: torch.optim.Optimizer | None, flow: str) -> Moved:
        """Collective: rank w holds the experts of row w of `assignment` from
        now on (see MoELayer.place); `flow`: the layer's."""
        if flow in ("data_centric", "model_centric"):
            raise ValueError(f"MoELayer.place moves whole experts, but with flow={flow!r} every rank holds a hidden "
                             "slice of every expert: there is no placement to choose")
        if flow == "flex":
            raise ValueError("MoELayer.place: a FlexMoE layer (flow='flex') places vExpert slots; use adjust() or "
                             "rebalance()")
        if experts.sharers > 1:
            raise ValueError(f"MoELayer.place moves whole experts, but {experts.sharers} ranks share each of the "
                             f"{experts.num_experts} experts (num_experts_per_device < 0): there is no placement "
                             "to choose")
        num_experts = self.positions.size
        table = np.full(num_experts, -1, dtype=np.int64)

        def describe() -> bytes:
            table[:] = as_assignment(assignment, num_experts, comm.size).reshape(-1)
            return table.tobytes()

        tensors = agree_on_move(comm, f"MoELayer.place on rank {comm.rank}", experts, optimizer, describe,
                                "assignment")
        new = np.empty_like(self.positions)
        new[table] = np.arange(table.size)
        moved = move_experts(tensors, self.positions, new, comm)
        self.positions = new
        identity = (new == np.arange(new.size)).all()
        self._table = None if identity else torch.from_numpy(new)
        self._on_device = {}
        return moved
