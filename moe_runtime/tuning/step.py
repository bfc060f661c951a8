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

Each step's time is reported with the trial that step ran (with micro-batches
in flight, not the last one chosen). A recomputation (activation
checkpointing, moe_runtime.common.recompute) runs its forward's configuration,
reports nothing and starts no trial; under a reentrant checkpoint the forward
records nothing and times no step, and the recomputation's clock (its forward
and the backward) times it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import a2a

from ..common.host_values import all_reduce_values
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


def _own(candidates: list[tuple[Config, torch.Tensor]], mark: torch.Tensor, comm: a2a.Comm) -> int | None:
    """Which of the kept (config, mark) of one key, newest first, is this
    call's: the newest whose mark equals its own (bit for bit) on every rank,
    else the newest. Collective (every rank keeps the same configurations,
    so all come here together) where their configurations differ; where
    they do not, None (any serves, and none is taken: each stays for its own
    call), and no mark is read."""
    if all(config == candidates[0][0] for config, _ in candidates):
        return None
    marks = torch.stack([kept for _, kept in candidates]).view(torch.int64)
    mine = (marks == mark.view(torch.int64)).to(torch.int64).cpu().numpy()
    everywhere = all_reduce_values(mine, comm, op="min")
    return int(np.argmax(everywhere)) if everywhere.any() else 0


class _TimedStep:
    """One call's step on the clock: the trial it runs, named by trial() after the clock started."""

    trial: tuple[int, Config] | None = None


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
        self._finished: tuple[int, Config] | None = None  # the trial of that step
        self._step = _TimedStep()  # the call being made
        # The forwards' configurations, for their recomputations; each with a mark of its tokens (a device
        # scalar), read only to tell apart calls of one capacity in flight together.
        self._kept: KeptDecisions[tuple[Config, torch.Tensor]] = KeptDecisions()
        self._mark: torch.Tensor | None = None

    def start(self, tokens: torch.Tensor, recording: bool,
              training: bool = False) -> tuple[torch.Tensor, Callable[[], None]]:
        """Starts the clock: the tokens to use (with the StepClock when
        recording) and the stop to call at the end of a forward that records
        nothing. Such a forward in training is taken for a reentrant
        checkpoint's, whose recomputation's clock times the step: it times none."""
        # Only a training call outside inference_mode is kept for a recomputation, and marked.
        keeps = self.dictionary is not None and training and not torch.is_inference_mode_enabled()
        self._mark = tokens.detach().sum(dtype=torch.float64) if keeps else None
        if not self.timed:
            return tokens, _nothing
        begun, step = self.timer(), _TimedStep()
        self._step = step

        def stop() -> None:
            self.step_seconds, self._finished = self.timer() - begun, step.trial

        if recording:
            # Makes the clock's backward run even if x needs no grad; on the tokens' device, so that autograd
            # sees one device in the clock's inputs.
            anchor = torch.zeros((), device=tokens.device, requires_grad=True)
            return StepClock.apply(tokens, anchor, stop), lambda: None
        return tokens, _nothing if training else stop

    def seconds_column(self) -> int:
        """The previous step's seconds for the agreement row, in nanoseconds."""
        return NOT_MEASURED if self.step_seconds is None else int(self.step_seconds * 1e9)

    def agreed(self, column: np.ndarray) -> None:
        """Every rank's last finished step (the agreed column): its trial's time is their maximum."""
        if recomputing():
            return
        if self._finished is not None and self.dictionary is not None and (column >= 0).all():
            capacity, config = self._finished
            self.dictionary.report(capacity, config, float(column.max()) / 1e9)
        self._finished, self.step_seconds = None, None

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
        key, mark = (capacity, signature["dtype"], top_k), self._mark
        if recomputing():
            # (an unmarked call, in eval mode, was not kept: it can only take the newest of its key)
            kept = self._kept.take(key, None if mark is None else lambda candidates: _own(candidates, mark, comm))
            if kept is not None:
                return kept[0]
        config = self.choose(capacity)
        if mark is not None:
            self._kept.keep(key, (config, mark))
        return config

    def choose(self, capacity: int) -> Config | None:
        """The dictionary's configuration at `capacity` (None without a dictionary)."""
        return None if self.dictionary is None else self.dictionary.choose(capacity)

    def trial(self, capacity: int, config: Config, timed: bool) -> None:
        """What this step runs (a recomputation: its forward's): reported with its time when `timed`."""
        self._step.trial = (capacity, config) if timed else None
