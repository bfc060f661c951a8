"""The per-call agreement, kept while every rank's row repeats.

A training loop calls a layer with the same arguments and token counts step
after step, and at a capacity factor f > 0 the capacity follows from them
alone (Tutel's rule). Then the agreement's all-gather (flows/agreement.py),
a round per forward, and on a CUDA communicator a copy back to the host that
waits for the stream, learns nothing new. This keeps it::

    call n    every rank's row (seconds aside) equals its row of call n - 1,
              the agreed tables of n - 1 and n - 2 were equal, f > 0 on every
              rank, and the flow's first collective of the call is an exchange
              on the exchanges' communicator (Flow.keeps_agreement)
                  -> no all-gather: the flow runs with the kept agreement
    otherwise     the all-gather, as before; while the agreement is kept it
                  runs on the exchanges' communicator, else on the layer's
                  host twin (common/host_values.py: over MPI, with no wait
                  for the GPU, where MPI is beneath a CUDA communicator)

Every rank decides from agreed tables alone whether the agreement is kept,
so all decide alike. A rank whose row changed (other tokens, arguments, an
error of its own) cannot keep it, and runs the all-gather on the exchanges'
communicator, where the other ranks' first exchange meets it: a collective
of another kind, which raises MismatchError on every rank (the check inside
the collectives' messages). Every rank then runs the all-gather again, with
every other, and the call goes on from there: a changed row costs one round
more, once, and the errors of a real mismatch (a field that differs, a rank
that failed) come from that second all-gather as before.

What a kept agreement does not see: a rank that skips the layer's call and
makes another collective on the layer's communicator meets the others'
exchange on another communicator, and every rank's wait ends at the
communicator's timeout (A2A_TIMEOUT_S, naming the ranks that did not come)
instead of a MismatchError (tests/mpi_runtime/test_runtime_kept_timeout.py).
A communicator without the cross-rank check (cross_check=False) never keeps
the agreement: a changed row would go unseen. Nor does one whose exchanges
predict their check (Comm.predicts_check, MPI with NCCL): there the others'
exchange is predicted and enqueued when the changed rank's all-gather meets
it, so the mismatch retires the communicator instead of costing a round; the
all-gather, the same call every time, is predicted itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

import a2a

from .agreement import SECONDS, Agreed, CallRow, agree_call
from .base import Flow

T = TypeVar("T")

__all__ = ["KeptAgreement"]


class KeptAgreement:
    """One layer's kept agreement (see the module docstring)."""

    def __init__(self, comm: a2a.Comm, exchange_comm: a2a.Comm):
        # comm: where a call's all-gather runs when nothing is kept (the layer's communicator's host twin)
        self.comm, self.exchange_comm = comm, exchange_comm
        self.kept: Agreed | None = None  # the agreement the next call may keep
        self._row: np.ndarray | None = None  # this rank's row of it (seconds aside)
        self._table: np.ndarray | None = None  # the last agreed table (seconds aside)

    def agree_and_run(self, row: CallRow, owner: str, flow: Flow, run: Callable[[Agreed, np.ndarray | None], T]) -> T:
        """run(agreed, values) at the call's agreement: the kept one (values
        None), else the all-gather's (values: this rank's row, for record);
        on one rank its own row (values None: there is nothing to keep)."""
        if self.comm.size == 1:
            return run(agree_call(row, self.comm, owner, flow), None)
        values = row.values()
        comm = self.agreement_comm  # decided before anything changes it, alike on every rank
        kept = self._for_row(values)
        if kept is not None:
            try:
                return run(kept, None)
            except a2a.MismatchError:
                pass  # a rank's row changed: its all-gather met this call's first exchange on every rank
            self.forget()  # (after the except: the failed attempt's buffers are back in the layer's pool)
        try:
            agreed = agree_call(row, comm, owner, flow, values)  # after a failed kept call: with every rank
        except a2a.MismatchError:
            if comm is self.comm or kept is not None:
                raise
            # This rank's row changed; the other ranks' first exchange (or all-gather) met this one: every
            # rank gathers once more, those that tried to keep the agreement for the first time.
            self.forget()
            agreed = agree_call(row, comm, owner, flow, values)
        return run(agreed, values)

    def _for_row(self, values: np.ndarray) -> Agreed | None:
        """The kept agreement when this rank's row repeats (and one is kept), else None."""
        if self.kept is None or not np.array_equal(_without_seconds(values), self._row):
            return None
        return self.kept

    @property
    def agreement_comm(self) -> a2a.Comm:
        """Where this call's all-gather runs: the exchanges' communicator while
        an agreement is kept (the other ranks' first exchange is there), else
        the layer's."""
        return self.comm if self.kept is None else self.exchange_comm

    def record(self, values: np.ndarray, agreed: Agreed, keeps: bool) -> None:
        """After an all-gather (`values`: this rank's row): keeps `agreed` for
        the next call when the table repeated and `keeps` (the call's flow
        and configuration allow it: the same on every rank)."""
        if self.comm.size == 1:  # nothing to keep: one rank's agreement is its own row, gathered from no one
            return
        table = _without_seconds(agreed.table)
        repeated = self._table is not None and np.array_equal(table, self._table)
        usable = keeps and repeated and agreed.fixed_capacity and self.comm.cross_check
        usable = usable and not self.exchange_comm.predicts_check
        self.kept = agreed if usable else None
        self._row = _without_seconds(values) if usable else None
        self._table = table

    def forget(self) -> None:
        """A kept agreement that a rank did not keep (its first exchange raised)."""
        self.kept, self._row, self._table = None, None, None


def _without_seconds(values: np.ndarray) -> np.ndarray:
    """A row, or a table's rows, without the column that changes every step."""
    return np.delete(values, SECONDS, axis=-1)
