"""Sample-assignment caching (DynaMoE, Section 4.2): the cache and its policy.

Keyed by sample id, the cache holds the experts each token of the sample
was routed to the last time the sample was seen: an int array (L, k) per
id, L tokens per sample, k choices per token. The entry predicts the
sample's next assignment. A choice (t, j) of this call is a *hit* when its
expert is among the token's predicted experts (its row is then already at
that expert when the prediction was dispatched; the order of the k
choices does not matter); any other choice, a token of an unseen sample
included, is a *miss*.

The score is a moving average of the fraction of unchanged choices among
the samples the cache knew (DynaMoE's metric: the samples not reassigned
since their last visit; unseen samples tell nothing of convergence and do
not count, though they are misses), a bias-corrected exponential average
with weight ``decay`` on the past::

    f_i = hits_i / (choices of known samples)_i
    a_i = decay a_(i-1) + (1 - decay) f_i,   w_i = decay w_(i-1) + (1 - decay),   score_i = a_i / w_i

so the first call's score is its own fraction. Every rank keeps its own;
one all-gather per call (:meth:`AssignmentCache.agree`) makes the on/off
decision on the lowest score of the ranks, with hysteresis: caching turns
on when it reaches ``on_threshold`` and off when it drops below
``off_threshold`` (DynaMoE's code: 0.95 and 0.85; its paper's experiment
of Fig. 10: 0.96 and 0.90). Every rank computes the decision from the same
gathered values, so all take the same one. The layer's flow that uses the
prediction is moe_runtime.deployment.cached_dispatch; docs/runtime.md draws it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import a2a

from ..common.agreement import CallFields
from ..common.host_values import all_gather_values
from ..common.recompute import KeptDecisions

__all__ = ["AssignmentCache", "AssignmentStats", "check_sample_ids", "predicted_choices"]

_SCORE_UNIT = 10**9  # scores travel as integers (parts per billion) in the agreement
_NO_SCORE = -1
_BAD_IDS = 2  # the ids state of a rank whose sample_ids were bad (0: none, 1: given)


@dataclass(frozen=True)
class AssignmentStats:
    """One call with sample ids, on this rank (``MoELayer.assignment_stats``).

    ``hits`` / ``misses``: this rank's choices whose expert the cache did /
    did not predict; ``score``: this rank's moving average after the call
    (None before any choice was seen); ``cached``: the predicted dispatch
    ran (the same on every rank); ``corrected``: rows this rank sent to
    other ranks in the correction (when ``cached``); ``unused``: predicted
    rows this rank dispatched that no choice used (when ``cached``)."""

    hits: int
    misses: int
    score: float | None
    cached: bool
    corrected: int = 0
    unused: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class AssignmentCache:
    """The assignments of the samples seen last, their score and the on/off state.

    ``on_threshold`` / ``off_threshold``: the hysteresis of the decision (see
    the module docstring), 0 <= off <= on <= 1. ``decay``: the moving
    average's weight on the past, in [0, 1). ``max_samples``: at most this
    many samples are kept (the least recently seen are forgotten first);
    None: every sample (an entry costs L k 4 bytes, 2 with E <= 32767).

    One cache serves one layer (the assignments are the layer's)."""

    def __init__(self, *, on_threshold: float = 0.95, off_threshold: float = 0.85, decay: float = 0.9,
                 max_samples: int | None = None):
        for name, value in (("on_threshold", on_threshold), ("off_threshold", off_threshold)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"AssignmentCache: {name} must be a number in [0, 1], got {value!r}")
        if off_threshold > on_threshold:
            raise ValueError(f"AssignmentCache: off_threshold ({off_threshold}) must not exceed on_threshold "
                             f"({on_threshold}): caching would turn on and off in the same call")
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 <= decay < 1.0:
            raise ValueError(f"AssignmentCache: decay must be a number in [0, 1), got {decay!r}")
        if max_samples is not None and (not isinstance(max_samples, int) or isinstance(max_samples, bool)
                                        or max_samples < 1):
            raise ValueError(f"AssignmentCache: max_samples must be a positive integer or None, got {max_samples!r}")
        self.on_threshold, self.off_threshold = float(on_threshold), float(off_threshold)
        self.decay, self.max_samples = float(decay), max_samples
        self.active = False  # the agreed decision of the last call
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()
        self._average = self._weight = 0.0
        self._owner: int | None = None
        # Each forward's (decision, prediction), for its recomputation (moe_runtime.common.recompute).
        self.kept: KeptDecisions[tuple[bool, np.ndarray]] = KeptDecisions()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def score(self) -> float | None:
        """This rank's moving average of the hit fraction; None before any choice was seen."""
        return self._average / self._weight if self._weight else None

    def bind(self, owner: object) -> None:
        """Ties the cache to one layer: a second layer would mix two layers' assignments."""
        if self._owner is not None and self._owner != id(owner):
            raise ValueError("AssignmentCache: this cache already serves another layer; give each layer its own")
        self._owner = id(owner)

    def lookup(self, sample_ids: np.ndarray, tokens_per_sample: int, top_k: int) -> np.ndarray:
        """(B L, k) int64: the cached experts of the samples' tokens, sample
        after sample; -1 (not routed) for a sample without an entry of shape (L, k)."""
        predicted = np.full((len(sample_ids) * tokens_per_sample, top_k), -1, dtype=np.int64)
        shape = (tokens_per_sample, top_k)
        for i, sample in enumerate(sample_ids.tolist()):
            entry = self._entries.get(sample)
            if entry is not None and entry.shape == shape:
                predicted[i * tokens_per_sample : (i + 1) * tokens_per_sample] = entry
        return predicted

    def store(self, sample_ids: np.ndarray, indices: np.ndarray) -> None:
        """Remembers `indices` (B L, k), sample after sample, as the samples' assignments."""
        count = len(sample_ids)
        if count == 0:
            return
        if indices.ndim != 2 or indices.shape[0] % count:
            raise ValueError(f"AssignmentCache.store: indices {indices.shape} do not split into {count} samples")
        dtype = np.int16 if indices.size == 0 or int(indices.max()) < 2**15 else np.int32
        per_sample = indices.astype(dtype).reshape(count, -1, indices.shape[1])
        for sample, entry in zip(sample_ids.tolist(), per_sample):
            self._entries[sample] = entry.copy()
            self._entries.move_to_end(sample)
        while self.max_samples is not None and len(self._entries) > self.max_samples:
            self._entries.popitem(last=False)

    def observe(self, hits: int, choices: int) -> None:
        """One call's hits among `choices` (of known samples) into the moving
        average (nothing when there were none)."""
        if choices:
            self._average = self.decay * self._average + (1.0 - self.decay) * hits / choices
            self._weight = self.decay * self._weight + (1.0 - self.decay)

    def agree(self, comm: a2a.Comm, ids_given: bool, error: Exception | None = None,
              call: CallFields | None = None) -> bool:
        """Collective (one all-gather on `comm`): checks that every rank did or
        did not pass sample ids, and, when they did, updates and returns the
        on/off decision from the lowest score (ranks without a score yet do
        not count; with none at all, caching stays off). `error`: this rank's
        ids were bad; it is raised here, and a RemoteError on the other ranks.
        `call`: the call's tokens (model dim, dtype), checked first."""
        score = self.score
        state = _BAD_IDS if error is not None else int(ids_given)
        extra = [] if call is None else call.columns()
        row = np.array([state, _NO_SCORE if score is None else round(score * _SCORE_UNIT), *extra], dtype=np.int64)
        table = all_gather_values(row, comm).reshape(comm.size, len(row))
        if call is not None:
            call.check(table[:, 2:])
        states = table[:, 0]
        if error is not None:
            raise error
        if (states == _BAD_IDS).any():
            bad = ", ".join(str(i) for i in np.flatnonzero(states == _BAD_IDS))
            raise a2a.RemoteError(f"MoELayer on rank {comm.rank}: rank(s) {bad} passed bad sample_ids")
        if (states != states[0]).any():
            shown = ", ".join(f"rank {i}: {'given' if g else 'not given'}" for i, g in enumerate(states))
            raise a2a.MismatchError(f"MoELayer on rank {comm.rank}: the ranks differ in sample_ids ({shown}); "
                                    "every rank must pass them, or none")
        if not ids_given:
            return False
        scores = table[:, 1][table[:, 1] != _NO_SCORE]
        if scores.size == 0:
            self.active = False
        else:
            lowest = int(scores.min()) / _SCORE_UNIT
            self.active = lowest >= (self.off_threshold if self.active else self.on_threshold)
        return self.active


def predicted_choices(actual: np.ndarray, predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hit, column), both (T, k): whether choice (t, j)'s expert is among
    token t's predicted experts, and which predicted column holds it (0
    where it is not). Choices not routed (negative) are never hits."""
    if actual.shape[0] != predicted.shape[0]:
        raise ValueError(f"predicted_choices: {actual.shape[0]} tokens against {predicted.shape[0]} predicted")
    same = (actual[:, :, None] == predicted[:, None, :]) & (actual[:, :, None] >= 0)
    return same.any(axis=2), same.argmax(axis=2)


def check_sample_ids(sample_ids: Any, num_tokens: int, rank: int) -> tuple[np.ndarray, int]:
    """(ids (B,) int64, tokens per sample L = T / B) from ``sample_ids``: a
    sequence, a NumPy array or a torch tensor of B distinct integers, one per
    sample of the batch; sample i owns tokens [i L, (i + 1) L) of the (T, M)
    tokens (x of shape (B, L, M), or (B L, M) sample after sample)."""
    where = f"MoELayer on rank {rank}: sample_ids"
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.dtype.is_floating_point or sample_ids.dtype.is_complex or sample_ids.dtype == torch.bool:
            raise TypeError(f"{where} must be integers, got a {sample_ids.dtype} tensor")
        ids = sample_ids.detach().cpu().numpy()
    else:
        ids = np.asarray(sample_ids)
        if ids.size == 0:
            ids = ids.astype(np.int64)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{where} must be integers (one id per sample), got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{where} must be one-dimensional (one id per sample), got shape {ids.shape}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{where} must fit in int64, got {int(ids.max())}")
    count = ids.size
    if count == 0:
        if num_tokens:
            raise ValueError(f"{where} is empty but the input has {num_tokens} tokens")
        return ids.astype(np.int64), 0
    if num_tokens % count:
        raise ValueError(f"{where} has {count} ids for {num_tokens} tokens: every sample must have the same "
                         f"number of tokens (T / len(sample_ids) whole)")
    unique, seen = np.unique(ids, return_counts=True)
    if (seen > 1).any():
        raise ValueError(f"{where} repeats id {int(unique[seen > 1][0])}: each sample of a batch needs its own id")
    return ids.astype(np.int64), num_tokens // count
