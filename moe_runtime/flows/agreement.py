"""The per-call agreement: one small all-gather of one int64 row per rank.

It carries what every rank must share before a flow runs, and checks what
every rank must have passed alike, so that a rank that differs raises on
every rank (naming the field and each rank's value) instead of leaving the
others in a collective of another size::

    column     agreed as               why
    capacity   max over ranks          the routing's rows per expert
    tokens     every rank's            the uneven collectives' counts
    seconds    max over ranks          the previous step's time (the tuner)
    top_k, gate_index, adaptive_r, a2a_ffn_overlap_degree, algo, flow
                                       equal on every rank, else MismatchError
    refused    zero on every rank      per-call arguments the layer's flow
                                       does not take
    recording  any rank's              some rank's autograd records the call
    fixed      all ranks' 1            the capacity follows from f > 0 and the
                                       tokens alone (flows/kept.py keeps the
                                       agreement only then)
    model dim, dtype, failed           the tokens' (common.agreement.CallFields):
                                       equal, else MismatchError; a rank whose
                                       own checks or gate failed raises its
                                       error, the others a RemoteError
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import a2a

from ..common.agreement import CallFields
from ..common.host_values import all_gather_values
from ..tuning.dictionary import FLOWS
from .base import CALL_ARGUMENTS, Flow, Request

__all__ = ["SECONDS", "Agreed", "CallRow", "agree_call"]

NOT_GIVEN = -1
ALGORITHMS = tuple(a2a.ALGORITHMS)
_COLUMNS = ("capacity", "top_k", "gate_index", "adaptive_r", "a2a_ffn_overlap_degree", "algo", "flow", "tokens",
            "seconds", "refused", "recording", "fixed")  # then CallFields' columns
SECONDS = _COLUMNS.index("seconds")
_EQUAL = ("top_k", "gate_index", "adaptive_r", "a2a_ffn_overlap_degree", "algo", "flow")


@dataclass
class CallRow:
    """This rank's side of the agreement."""

    capacity: int
    top_k: int
    gate_index: int
    request: Request
    tokens: int
    seconds: int
    refused: list[str]
    call: CallFields  # the tokens' model dim and dtype, and this rank's own error
    recording: bool = False  # autograd records this rank's call
    fixed_capacity: bool = False  # the capacity follows from the factor (f > 0) and the tokens alone

    def values(self) -> np.ndarray:
        r, d, algo, flow = self.request.r, self.request.d, self.request.algo, self.request.flow
        return np.array([
            self.capacity, self.top_k, self.gate_index, _code(r), _code(d),
            ALGORITHMS.index(algo) if algo in ALGORITHMS else NOT_GIVEN,
            FLOWS.index(flow) if flow in FLOWS else NOT_GIVEN, self.tokens, self.seconds, len(self.refused),
            int(self.recording), int(self.fixed_capacity), *self.call.columns()], dtype=np.int64)


@dataclass(frozen=True)
class Agreed:
    capacity: int
    token_counts: list[int]
    seconds: np.ndarray  # every rank's previous step (ns; NOT_GIVEN where not measured)
    recording_anywhere: bool = False  # some rank's autograd records this call
    fixed_capacity: bool = False  # every rank's capacity follows from f > 0 and its tokens alone
    table: np.ndarray | None = None  # every rank's row (W, columns), as gathered; None on one rank


def agree_call(row: CallRow, comm: a2a.Comm, owner: str, flow: Flow, values: np.ndarray | None = None) -> Agreed:
    """The all-gather, then the checks in the order that names the cause:
    the tokens and a rank's own error, then refused arguments, then the
    fields that differ. On one rank the row is the table: only its own
    error and its refused arguments can raise. `values`: ``row.values()``
    when the caller made it already."""
    if comm.size == 1:  # (the row's values are not even made: a step on one rank pays nothing for them)
        if row.call.error is not None:
            raise row.call.error
        if row.refused:
            _refuse(f"{owner} on rank 0", flow, [0], row)
        return Agreed(row.capacity, [row.tokens], np.array([row.seconds], dtype=np.int64), row.recording,
                      row.fixed_capacity)
    values = row.values() if values is None else values
    where = f"{owner} on rank {comm.rank}"
    table = all_gather_values(values, comm).reshape(comm.size, len(values))
    column = {name: table[:, i] for i, name in enumerate(_COLUMNS)}
    row.call.check(table[:, len(_COLUMNS):])
    refusing = np.flatnonzero(column["refused"]).tolist()
    if refusing:
        _refuse(where, flow, refusing, row)
    for name in _EQUAL:
        given = column[name]
        if (given != given[0]).any():
            shown = ", ".join(f"rank {i}: {_shown(name, v)}" for i, v in enumerate(given))
            raise a2a.MismatchError(f"{where}: the ranks passed different {name} ({shown}); every rank must call "
                                    "the layer with the same arguments")
    return Agreed(int(column["capacity"].max()), column["tokens"].tolist(), column["seconds"],
                  bool(column["recording"].any()), bool(column["fixed"].all()), table)


def _refuse(where: str, flow: Flow, refusing: list[int], row: CallRow) -> None:
    mine = f"; this rank passed {row.refused}" if row.refused else ""
    refused = [name for name in CALL_ARGUMENTS if name not in flow.takes]
    raise ValueError(f"{where}: flow={flow.name!r} takes none of {refused} ({flow.why_refused}), but "
                     f"rank(s) {refusing} passed some{mine}")


def _code(value: int | None) -> int:
    return NOT_GIVEN if value is None else int(value)


def _shown(name: str, value: int) -> str:
    if value == NOT_GIVEN:
        return "not given"
    if name == "flow":
        return FLOWS[value]
    return ALGORITHMS[value] if name == "algo" else str(value)
