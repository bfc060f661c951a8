"""The dictionary's step protocol: how a layer times its steps, reports
them and asks what to run, so that every rank decides the same thing.

One step of a layer with a dictionary (moe_runtime.tuning.dictionary)::

    forward:  start = timer()
              tokens pass through StepClock (identity; its backward is the
                  layer's last, and stops the clock)
              the call's agreement row carries the PREVIOUS step's seconds
                  (seconds_column); agreed() takes their maximum over ranks
                  and reports it for the trial that step ran
              choose(capacity) -> the configuration of this step's trial
              trial(capacity, choice): what this step runs, for the next report
    backward: StepClock stops the clock (a call that records no graph stops it
              at the end of forward)

Reports therefore lag one step, and travel in an all-gather the layer makes
anyway. The binding (bind) names the dictionary's table: the layer's
signature (world, nodes, E, M, H, k, dtype, device) and search space.

A recomputation (activation checkpointing, moe_runtime.common.recompute) runs
its forward's configuration, reports nothing and starts no trial; its clock
goes on from where the forward's stopped (a reentrant checkpoint's forward
records nothing), so that the step's time is forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import a2a

from ..common.recompute import KeptDecisions, recomputing
from .dictionary import AdaptiveDictionary, Config

__all__ = ["NOT_MEASURED", "StepClock", "StepTuning"]

NOT_MEASURED = -1  # the seconds column of a step that was not timed


def _nothing() -> None:
    """The stop of an untimed step."""


class StepClock(torch.autograd.Function):
    """Identity on the layer's tokens whose backward, the last of the layer's,
    stops the clock of the step (forward + backward)."""

    @staticmethod
    def forward(ctx, tokens, anchor, stop):
        ctx.stop = stop
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad):
        ctx.stop()
        return grad, None, None


class StepTuning:
    """One layer's side of the protocol (see the module docstring);
    ``dictionary`` None: nothing is chosen, and steps are timed only when
    ``timed`` (a flow reads them: FlexMoE's); untimed, the clock costs no op."""

    def __init__(self, dictionary: AdaptiveDictionary | None, timer: Callable[[], float], timed: bool = True):
        self.dictionary = dictionary
        self.timer = timer
        self.timed = timed or dictionary is not None
        self.signature: dict[str, Any] | None = None  # the bound table's
        self.step_seconds: float | None = None  # the last finished step's, this rank's
        self._trial: tuple[int, Config] | None = None  # (capacity, config) of the step being timed
        self._kept: KeptDecisions[Config] = KeptDecisions()  # the forwards' configurations, for recomputations

    def start(self, tokens: torch.Tensor, recording: bool) -> tuple[torch.Tensor, Callable[[], None]]:
        """Starts the clock: the tokens to use (with the StepClock when
        recording) and the stop to call at the end of a forward that records nothing."""
        if not self.timed:
            return tokens, _nothing
        # A recomputation's clock goes on from the forward's: a reentrant checkpoint's forward stopped its own.
        begun = self.timer() - ((self.step_seconds or 0.0) if recording and recomputing() else 0.0)

        def stop() -> None:
            self.step_seconds = self.timer() - begun

        if recording:
            # Makes the clock's backward run even if x needs no grad; on the tokens' device, so that autograd
            # sees one device in the clock's inputs.
            anchor = torch.zeros((), device=tokens.device, requires_grad=True)
            return StepClock.apply(tokens, anchor, stop), lambda: None
        return tokens, stop

    def seconds_column(self) -> int:
        """The previous step's seconds for the agreement row, in nanoseconds."""
        return NOT_MEASURED if self.step_seconds is None else int(self.step_seconds * 1e9)

    def agreed(self, column: np.ndarray) -> None:
        """Every rank's previous step (the agreed column): the trial's time is its maximum."""
        if recomputing():
            return
        if self._trial is not None and self.dictionary is not None and (column >= 0).all():
            capacity, config = self._trial
            self.dictionary.report(capacity, config, float(column.max()) / 1e9)
        self._trial, self.step_seconds = None, None

    def bind(self, signature: dict[str, Any], valid_rs: Sequence[int], comm: a2a.Comm, flows: Sequence[str]) -> None:
        """Binds the dictionary to the table of `signature` (again only when it changed)."""
        if signature != self.signature:
            two_level = comm.num_nodes > 1 and comm.local_size > 1
            self.dictionary.bind(signature, valid_rs, two_level, writer=comm.rank == 0, flows=tuple(flows))
            self.signature = signature

    def choose_for(self, layer: Any, capacity: int, dtype: torch.dtype, top_k: int) -> Config | None:
        """The dictionary's configuration for a call of `layer` at the agreed
        capacity (None without one), bound to the table of the layer's signature."""
        if self.dictionary is None:
            return None
        comm = layer.comm
        signature = {"world": comm.size, "local_size": comm.local_size, "num_nodes": comm.num_nodes,
                     "experts": layer.num_global_experts, "model_dim": layer.model_dim,
                     "hidden": layer.experts.hidden_size, "top_k": top_k, "dtype": str(dtype).removeprefix("torch."),
                     "device": comm.device}
        self.bind(signature, layer.valid_rs, comm, layer.flows)
        key = (capacity, signature["dtype"], top_k)
        if recomputing():
            kept = self._kept.take(key)
            if kept is not None:
                return kept
        config = self.choose(capacity)
        self._kept.keep(key, config)
        return config

    def choose(self, capacity: int) -> Config | None:
        """The dictionary's configuration at `capacity` (None without a dictionary)."""
        return None if self.dictionary is None else self.dictionary.choose(capacity)

    def trial(self, capacity: int, config: Config, timed: bool) -> None:
        """What this step runs: reported at the next agreement when `timed`."""
        if recomputing():
            return
        self._trial = (capacity, config) if timed else None
