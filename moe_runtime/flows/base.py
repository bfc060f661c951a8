"""The Flow interface: the one way the layer runs experts on routed tokens.

A layer holds the flow its construction named (``MoELayer(flow=...)``) and,
when it has a dictionary with other flows (``flows=``), those too, all
built once, at construction, over the layer's one expert layout. Every call
goes gate -> agree -> flow -> output (moe_runtime.layer); the flow is the
last step but one::

    Flow.layout(...)        at construction: the expert layout it runs on
                            (Tutel's whole or shared experts, Hexa-MoE's
                            hidden-sharded ones, FlexMoE's vExpert slots)
    Flow.local_capacity()   this rank's capacity, before the agreement
    Flow.configure(request, chosen) -> Choice
                            the call's configuration: its arguments, else
                            the dictionary's choice, else the defaults
    Flow.run(call) -> (y, Plan)
                            this rank's outputs (T, M), autograd recording
                            the backward, and what ran (:class:`Plan`, the
                            same fields for every flow; the tuner's and the
                            benchmarks' measurements)

A flow refuses what it cannot honour: per-call arguments it does not take
(``takes``), a layer it cannot run on (:meth:`Flow.check_layer`). The
implementations: Tutel's capacity flow (moe_runtime.flows.expert), dropless
and its two caches (moe_runtime.deployment), dynamic capacity
(moe_runtime.dynamic), FlexMoE (moe_runtime.flex), Hexa-MoE's data- and
model-centric flows (moe_runtime.hexa); moe_runtime.registry names them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

import a2a

from ..common.agreement import CallFields
from ..common.buffers import BufferPool
from ..common.overlap import Overlap
from ..experts.ffn import FFNExperts
from ..gating.gates import GateDecision
from ..tuning.dictionary import Config, flow_config

__all__ = ["Call", "Choice", "Context", "Flow", "Plan", "Request", "WholeExpertFlow"]

# The per-call arguments a flow may take (Flow.takes).
CALL_ARGUMENTS = ("adaptive_r", "a2a_ffn_overlap_degree", "algo", "capacity_factor")


@dataclass(frozen=True)
class Plan:
    """What one call runs: parallelism r, pipelining degree d, algorithm, and
    the capacities (``capacity``: what routing used, agreed across ranks;
    ``buffer_capacity``: rows per expert in the buffers, a multiple of d*g;
    with per-expert capacities, ``capacities`` (E,) holds them and both are
    the largest). ``dropped``: this rank's routed choices that did not fit."""

    r: int
    d: int
    algo: str
    capacity: int
    buffer_capacity: int
    # this rank's routed choices that did not fit: a number, or the a2a.Routing that counts
    # them, read when `dropped` is (on a GPU that waits for the device: the step itself does not)
    dropped_by: int | a2a.Routing = 0
    rows_sent: int | None = None  # rows this rank sends to other ranks in each exchange of the call
    capacities: tuple[int, ...] | None = None  # per-expert capacities (flow="dynamic")
    # "expert" for the flows over whole or shared experts; Hexa-MoE's "data_centric" (r = 0: the
    # experts gathered whole) or "model_centric" (r = W: every rank holds a slice of every expert)
    # when the layer's experts are sharded along H, for which capacity is the most tokens on a rank
    # and rows_sent the token rows it all-gathers.
    parallel: str = "expert"
    # Which flow ran (moe_runtime.registry's name): "expert" (r, d, algo above), "dropless", "dynamic",
    # "flex", "data_centric", "model_centric".
    flow: str = "expert"
    # The dropless flow's small inference calls: through a2a.LowLatencyBuffer (one message per peer).
    low_latency: bool = False

    @property
    def dropped(self) -> int:
        """This rank's routed choices that did not fit their expert's capacity."""
        return self.dropped_by if isinstance(self.dropped_by, int) else self.dropped_by.num_dropped

    def __repr__(self) -> str:
        """The fields, with ``dropped`` read (on a GPU, a wait for the device) in place of where it is kept."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" if f.name != "dropped_by" else f"dropped={self.dropped}"
                 for f in fields(self)]
        return f"Plan({', '.join(shown)})"


@dataclass(frozen=True)
class Request:
    """A call's own settings, agreed across ranks (None: not given)."""

    r: int | None = None
    d: int | None = None
    algo: str | None = None
    flow: str | None = None
    capacity_factor: float | None = None

    @property
    def given(self) -> list[str]:
        """The per-call arguments given, by their names in MoELayer.forward."""
        values = (self.r, self.d, self.algo, self.capacity_factor)
        return [name for name, value in zip(CALL_ARGUMENTS, values, strict=True) if value is not None]

    @property
    def pins(self) -> bool:
        """Whether the call pins the expert flow's configuration (r, d or algo)."""
        return self.r is not None or self.d is not None or self.algo is not None


@dataclass(frozen=True)
class Choice:
    """A call's configuration: the dictionary's key (``config``), the
    algorithm the exchanges run, and whether the step is a trial of the
    dictionary (a step the user forced another way is not)."""

    config: Config
    algo: str
    timed: bool = True


@dataclass(frozen=True)
class Context:
    """What every flow of a layer shares, made once at construction."""

    comm: a2a.Comm  # the layer's: agreements and gathers
    exchange_comm: a2a.Comm  # the exchanges' own, so that a communication thread never shares one
    overlap: Overlap
    pool: BufferPool
    experts: torch.nn.Module  # the layout (Flow.layout)
    num_experts: int
    model_dim: int
    default_algo: str  # use_2dh's
    weight_grad_scale: float  # 1/W for expert_gradient="mean", else 1
    is_postscore: bool
    batch_prioritized_routing: bool
    timer: Callable[[], float]
    dispatch_format: str | None = None  # FP8 dispatch's a2a format (MoELayer(dispatch_dtype=)); None: the tokens'
    kept: Any = None  # the layer's KeptAgreement over comm and exchange_comm (flows/kept.py; binding makes it)


@dataclass
class Call:
    """One call as the flow sees it, after the gate and the agreement."""

    tokens: torch.Tensor  # (T, M)
    decision: GateDecision  # indices (T, k) by physical position, gates, scores
    choice: Choice
    capacity: int  # agreed: the max over ranks (0 for flows without a capacity)
    token_counts: list[int]  # every rank's T
    recording: bool  # autograd records this call (training)
    step_seconds: float | None = None  # the previous step's time on this rank (None: not measured)
    prepared: Any = None  # what Flow.begin started before the gate
    recording_anywhere: bool = False  # some rank's autograd records this call (agreed: the same on every rank)


class Flow:
    """One way to run the experts on routed tokens (see the module docstring)."""

    name: ClassVar[str]
    takes: ClassVar[frozenset[str]] = frozenset()  # per-call arguments it honours, of CALL_ARGUMENTS
    uses_capacity: ClassVar[bool] = False  # routes with the capacity the gate's factor gives
    fp8_dispatch: ClassVar[bool] = False  # carries FP8 rows to the experts (MoELayer(dispatch_dtype=))
    times_steps: ClassVar[bool] = False  # reads the previous step's time (Call.step_seconds): steps are timed

    def __init__(self, context: Context, settings: Any = None):
        self.context = context
        self.settings = settings

    # -- construction ------------------------------------------------------------
    @classmethod
    def layout(cls, spec: dict[str, Any], model_dim: int, comm: a2a.Comm, expert_seed: int,
               settings: Any) -> torch.nn.Module:
        """The expert layout this flow runs on, built from Tutel's experts dict."""
        return FFNExperts(spec, model_dim, comm, expert_seed)

    @classmethod
    def check_layer(cls, layer: Any) -> None:
        """What this flow needs of the layer's settings, checked at construction."""

    # -- a call ------------------------------------------------------------------
    def begin(self, tokens: torch.Tensor, top_k: int, sample_ids: Any, algo: str | None, call: CallFields) -> Any:
        """Work started before the gate (collective when it does anything: then
        it checks `call`, the tokens' fields, first); None by default."""
        if sample_ids is not None and call.error is None:  # raised in the agreement, with every rank
            call.error = ValueError("MoELayer: sample_ids are for sample-assignment caching; construct the layer "
                                    "with flow=moe_runtime.Dropless(assignment_cache=moe_runtime.AssignmentCache())")
        return None

    def settle(self) -> None:
        """Ends the flow's own communication in flight (a prefetch) before the call's agreement."""

    def local_capacity(self, decision: GateDecision, factor: float, rule: str, dropless: str) -> int:
        """This rank's capacity (rows per expert) before the agreement; 0 without one
        (`rule`, `dropless`: gating/capacity.py's)."""
        return 0

    def keeps_agreement(self, choice: Choice) -> bool:
        """Whether a call of `choice` may run on a kept agreement (flows/kept.py):
        its first collective is an exchange on ``context.exchange_comm`` made on
        the caller's thread, and nothing else of the call waits for a peer
        before it, so that a rank which did not keep the agreement is met there."""
        return False

    def configure(self, request: Request, chosen: Config | None) -> Choice:
        """The call's configuration (flows other than the expert flow have one)."""
        self.refuse(request)
        algo = self.context.default_algo if request.algo is None else request.algo
        return Choice(flow_config(self.name), algo, timed=algo == self.context.default_algo)

    def refused(self, request: Request) -> list[str]:
        """The call's arguments this flow does not take."""
        return [name for name in request.given if name not in self.takes]

    def refuse(self, request: Request) -> None:
        """ValueError for the call's arguments this flow does not take (they are agreed, so every rank raises)."""
        refused = set(self.refused(request))
        where = f"MoELayer on rank {self.context.comm.rank}: flow={self.name!r}"
        if refused & {"adaptive_r", "a2a_ffn_overlap_degree"}:
            raise ValueError(f"{where} has no r or pipelining degree to choose; adaptive_r and "
                             "a2a_ffn_overlap_degree are the expert flow's")
        if "algo" in refused:
            raise ValueError(f"{where} exchanges no rows by all-to-all; algo is the expert and dropless flows'")
        if refused:
            raise ValueError(f"{where} takes none of {sorted(refused)} ({self.why_refused})")

    why_refused: ClassVar[str] = "it has nothing of the kind to choose"

    def run(self, call: Call) -> tuple[torch.Tensor, Plan]:
        raise NotImplementedError

    # -- helpers for the implementations --------------------------------------------
    def whole_expert_weights(self, dtype: torch.dtype) -> tuple:
        """This rank's (fc1, fc1_bias, fc2, fc2_bias) of whole experts, in the
        tokens' `dtype` (under autocast the weights stay in theirs: cast as
        autocast casts a matmul's operands; no copy when the dtypes agree)."""
        return tuple(None if w is None else w.to(dtype) for w in self.context.experts.local_weights())


class WholeExpertFlow(Flow):
    """The flows that move rows to whole experts at r = 1, d = 1 (dropless,
    dynamic, FlexMoE): they take the call's algorithm, and r and d only as 1."""

    takes = frozenset({"adaptive_r", "a2a_ffn_overlap_degree", "algo"})
    why_refused = "nothing is dropped, so there is no capacity"

    @classmethod
    def check_layer(cls, layer: Any) -> None:
        whole_expert_layer(cls.name, layer)

    def configure(self, request: Request, chosen: Config | None) -> Choice:
        self.refuse(request)
        require_r1_d1(self.name, request.r, request.d, "adaptive_r")
        return super().configure(Request(algo=request.algo), chosen)


def require_r1_d1(name: str, r: int | None, d: int | None, r_name: str) -> None:
    """The whole-expert flows' r and d (None: not given), at construction and per call."""
    if r is not None and r != 1:
        raise ValueError(f"MoELayer(flow={name!r}) runs r = 1 only, got {r_name}={r}")
    if d is not None and d != 1:
        raise ValueError(f"MoELayer(flow={name!r}) runs d = 1 only (its rows have no capacity axis "
                         f"to pipeline), got a2a_ffn_overlap_degree={d}")


def whole_expert_layer(name: str, layer: Any) -> None:
    """What the flows that move whole experts' rows at r = 1, d = 1 need of the layer: E >= W, no
    dictionary, r = d = 1."""
    if layer.experts.sharers > 1:
        raise ValueError(f"MoELayer(flow={name!r}) needs whole experts on each rank (E >= W), but "
                         f"{layer.experts.sharers} ranks share each of the {layer.num_global_experts} experts; "
                         "use flow='expert' for shared experts")
    if layer.adaptive is not None:
        raise ValueError(f"MoELayer(flow={name!r}) runs r = 1, d = 1: there is nothing for the dictionary "
                         "(adaptive=, parallel_type='adaptive:auto') to choose")
    require_r1_d1(name, layer.default_r, layer.a2a_ffn_overlap_degree, "parallel_type r")
