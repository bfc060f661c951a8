"""Counting the torch ops a piece of code dispatches: on a GPU each is at
least one launch (views aside), so their number is a step's host cost that a
CPU can measure (``python -m moe_runtime.bench --overhead``, the step budgets
of tests/unit/test_runtime_step_budget.py)."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchedOps"]


class DispatchedOps(TorchDispatchMode):
    """``with DispatchedOps() as ops: ...``; then ``ops.ops``: a Counter of
    the ops dispatched, by name (``aten.mm.default`` counts as "mm")."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
