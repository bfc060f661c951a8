"""What the dictionary stores: a configuration (:class:`Config`) and the
result of a key's search (:class:`Entry`).

A configuration is Tutel's expert-parallel flow (``flow="expert"``) with
parallelism degree r, pipelining degree d and all-to-all algorithm, or one
of the other flows, which have nothing to tune (one configuration each,
:func:`flow_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALGOS", "DATA_PARALLEL", "FLOWS", "SOLO_FLOWS", "Config", "Entry", "flow_config"]

ALGOS = ("linear", "2dh")
# "expert": Tutel's flows of (r, d, algo); the others are one configuration each (the layer's flows=).
FLOWS = ("expert", "dropless", "data_centric", "model_centric")
# Flows that only run alone, never as the dictionary's choice: named so that every call's
# configuration is a Config (one configuration each, as the other flows).
SOLO_FLOWS = ("dynamic", "flex")
_PLACEHOLDER = (0, 1, "linear")  # (r, d, algo) of a flow other than "expert"


@dataclass(frozen=True)
class Config:
    """How to run one step: the expert-parallel flow (``flow="expert"``)
    with parallelism degree ``r`` (0 = data parallel), pipelining degree
    ``d``, all-to-all algorithm ``algo`` ("linear" or "2dh"); or another
    flow of ``FLOWS``, one configuration each (:func:`flow_config`: r, d and
    algo are the placeholders 0, 1, "linear")."""

    r: int
    d: int
    algo: str
    flow: str = "expert"

    def __post_init__(self) -> None:
        if self.flow not in FLOWS + SOLO_FLOWS:
            raise ValueError(f"unknown flow {self.flow!r}; the flows are {FLOWS + SOLO_FLOWS}")
        if self.flow != "expert" and (self.r, self.d, self.algo) != _PLACEHOLDER:
            raise ValueError(f"flow {self.flow!r} has no r, d or algo to choose: its configuration is "
                             f"flow_config({self.flow!r}) (r=0, d=1, 'linear'), got r={self.r}, d={self.d}, "
                             f"{self.algo!r}")

    def __str__(self) -> str:
        return f"r={self.r} d={self.d} {self.algo}" if self.flow == "expert" else self.flow


def flow_config(flow: str) -> Config:
    """The one configuration of a flow other than "expert"."""
    if flow == "expert":
        raise ValueError("the expert flow has many configurations (r, d, algo); give them: Config(r, d, algo)")
    return Config(*_PLACEHOLDER, flow)


DATA_PARALLEL = Config(0, 1, "linear")
"""r = 0 runs no all-to-all, so it is one configuration, reported as d = 1, "linear"."""


@dataclass(frozen=True)
class Entry:
    """The result of a key's search: the fastest configuration, its step time
    (seconds, the median over ``repeats`` steps), and how many trials the search ran."""

    config: Config
    seconds: float
    trials: int
