"""MoELayer: Tutel's MoE layer interface over a2a, in four steps per call.

::

    x (..., M) -> tokens (T, M)
    gate   -> scores (T, E), top-k indices and gates (T, k), l_aux
              (indices mapped to the experts' positions after place())
    agree  -> ONE small all-gather (moe_runtime.flows.agreement): the capacity
              (max over ranks) of a flow that routes with one, every rank's
              token count, the previous step's time for the dictionary, and
              a check that every rank passed the same arguments and tokens
              (none while every rank's row repeats at f > 0: flows/kept.py)
    flow   -> the layer's flow (chosen at construction) or the one the
              dictionary picks among the layer's flows= (moe_runtime.registry);
              Flow.configure, then Flow.run: y (T, M) and the call's Plan
    output -> y (..., M), with y.l_aux

docs/runtime.md draws the data of each flow at every step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import a2a

from .binding import bind_flows, check_rebind
from .common.agreement import CallFields
from .common.buffers import BufferPool
from .common.copying import LayerCopy
from .common.graphs import StepGraphs, autograd_records, call_in_graphs, complete_posted_checks
from .common.overlap import check_thread_level
from .common.precision import compute_dtype, dispatch_format, routing_precision
from .common.recompute import recomputing, trace_routing
from .construction import agreed_construction, agreed_seeds
from .deployment.positions import ExpertPositions
from .experts.ffn import EXPERT_TAG
from .experts.gradients import sync_shared_gradients
from .experts.relocation import Moved
from .experts.replicas import copy_replicas_from_rank0
from .flex.scheduler import Decision
from .flex.vexperts import Primitive
from .flow_state import FlowStateNames
from .flows.agreement import Agreed, CallRow
from .flows.base import Call, Flow, Plan, Request
from .flows.expert import parse_parallel_type, positive_degree
from .gating.capacity import set_by_tokens
from .gating.gates import decide, initialize_gate, make_gate
from .registry import call_capacity_factor, call_top_k, check_dictionary_layer, check_dispatch_dtype
from .tuning.dictionary import AdaptiveDictionary
from .tuning.step import StepTuning

__all__ = ["MoELayer", "sync_shared_gradients"]  # the latter re-exported from experts.gradients

# Tutel's settings of the expert flow, with their defaults: the other flows refuse them.
EXPERT_PARALLEL_DEFAULTS = {"parallel_type": "adaptive:1", "a2a_ffn_overlap_degree": 1, "use_2dh": False,
                            "adaptive": None, "capacity_rule": "tutel", "dropless_capacity": "largest",
                            "is_postscore": True,
                            "batch_prioritized_routing": False, "flows": ()}


class MoELayer(FlowStateNames, LayerCopy, torch.nn.Module):
    """A Mixture-of-Experts layer with Tutel's interface (see the module docstring).

    ``gate_type``: a dict (or a list of them, selected per call by
    ``gate_index``) ``{"type": "top" | "cosine_top", "k", "capacity_factor",
    "gate_noise", "fp32_gate", "z_loss_coef"}``, or a user's gate module
    (gating/custom.py). ``experts``: ``{"type":
    "ffn", "num_experts_per_device": n, "hidden_size_per_expert": H,
    "activation_fn": fn, "has_fc1_bias": True, "has_fc2_bias": True}``; n =
    -s < 0 makes s ranks share one expert. ``comm``: an ``a2a.Comm``.
    ``seeds=(gate_seed, expert_seed)``; None draws them on rank 0. What more
    than one rank holds whole (the gates, Hexa-MoE's fc2 bias) takes rank 0's
    values whatever each rank's seeds; the ranks must construct the layer
    alike (``a2a.MismatchError`` on every rank names a field that differs).

    ``flow``: what runs the experts on the routed tokens, a name or a settings
    object (moe_runtime.registry has the table): ``"expert"`` (default,
    Tutel's capacity flow), ``"dropless"`` / ``Dropless(expert_cache=,
    assignment_cache=)``, ``"dynamic"`` / ``DynamicCapacity(...)``,
    ``"flex"`` / ``FlexConfig(...)``, ``"data_centric"`` /
    ``DataCentric(hidden_split=, shared_cache=, kernels=)``, ``"model_centric"`` /
    ``ModelCentric(hidden_split=, kernels=)``. ``flows``: the other flows the
    dictionary of an expert layer may time and choose per capacity window,
    of ``"dropless"``, ``"data_centric"``, ``"model_centric"``.

    The expert flow's settings, Tutel's: ``parallel_type`` (``"adaptive:r"``,
    default r = 1; ``"data"``: r = 0; ``"model"``: r = s; ``"adaptive:auto"``
    / ``"auto"``: the dictionary, ``adaptive`` or a default
    :class:`AdaptiveDictionary`), ``a2a_ffn_overlap_degree`` (d),
    ``use_2dh`` (the default algorithm), ``capacity_rule`` (``"tutel"`` or
    ``"a2a"``), ``dropless_capacity`` (at capacity factor 0: ``"largest"``,
    the largest expert's count, read back (one host wait per call); or
    ``"worst_case"``, T, the most one expert can get: no wait, the same result,
    E / k times the buffers of f = 1; gating/capacity.py), ``is_postscore``,
    ``batch_prioritized_routing``. For every flow: ``normalize_gate``, ``is_gshard_loss``, ``expert_gradient``
    (``"mean"``: expert gradients divided by the world size, as DDP averages
    the shared ones; or ``"sum"``), ``timer`` (the clock of the steps).
    ``cuda_graphs``: N > 0 captures a training call's forward and backward
    into CUDA graphs and replays them, one pair per call signature, at most
    N (common/graphs.py says what is captured and what is refused).
    ``dispatch_dtype``: None, ``"float8_e4m3fn"`` or ``"float8_e5m2"``: the
    tokens go to the experts as FP8 rows with block scales, the rest in their
    dtype (moe_runtime.common.precision; flows "expert" and "dropless").

    Call: ``layer(x, capacity_factor=, top_k=, a2a_ffn_overlap_degree=,
    adaptive_r=, algo=, flow=, gate_index=, sample_ids=)`` -> y of x's shape,
    with ``y.l_aux``; ``layer.l_aux`` and ``layer.last_plan`` describe the
    last call. ``flow``: runs "expert" or one of the layer's ``flows`` this
    call instead of the dictionary's choice; without it, ``adaptive_r``,
    ``a2a_ffn_overlap_degree`` or ``algo`` pin the expert flow.
    ``sample_ids`` (flow ``Dropless(assignment_cache=...)``): B distinct
    integers, sample i owning tokens [i L, (i + 1) L) of x as (T, M).
    """

    def __init__(
        self,
        gate_type: dict[str, Any] | torch.nn.Module | Sequence[dict[str, Any] | torch.nn.Module],
        model_dim: int,
        experts: dict[str, Any],
        *,
        comm: a2a.Comm,
        seeds: tuple[int, int] | None = None,
        flow: Any = None,
        flows: Sequence[str] = (),
        parallel_type: str = "adaptive:1",
        a2a_ffn_overlap_degree: int = 1,
        use_2dh: bool = False,
        adaptive: AdaptiveDictionary | None = None,
        capacity_rule: str = "tutel",
        dropless_capacity: str = "largest",
        cuda_graphs: int = 0,
        is_postscore: bool = True,
        batch_prioritized_routing: bool = False,
        normalize_gate: bool = True,
        is_gshard_loss: bool = True,
        expert_gradient: str = "mean",
        dispatch_dtype: Any = None,
        timer: Callable[[], float] = time.perf_counter,
        **deprecated: Any,
    ):
        super().__init__()
        dispatch_dtype = None if dispatch_dtype is None else str(dispatch_dtype).removeprefix("torch.")
        # Checked and agreed across ranks before any other collective (MismatchError on every rank naming
        # the field that differs).
        flow_class, settings, others = agreed_construction(
            comm, gate_type, model_dim, experts, flow=flow, flows=flows, deprecated=deprecated,
            parallel_type=parallel_type, a2a_ffn_overlap_degree=a2a_ffn_overlap_degree, use_2dh=use_2dh,
            adaptive=adaptive, capacity_rule=capacity_rule, dropless_capacity=dropless_capacity,
            cuda_graphs=cuda_graphs, is_postscore=is_postscore, batch_prioritized_routing=batch_prioritized_routing,
            normalize_gate=normalize_gate, is_gshard_loss=is_gshard_loss, expert_gradient=expert_gradient,
            dispatch_dtype=dispatch_dtype)
        self.comm, self.model_dim, self.flows = comm, model_dim, tuple(others)
        self.parallel_type, self.use_2dh, self.capacity_rule = parallel_type, use_2dh, capacity_rule
        self.dropless_capacity, self.graphs = dropless_capacity, StepGraphs(cuda_graphs) if cuda_graphs else None
        self.a2a_ffn_overlap_degree = positive_degree(a2a_ffn_overlap_degree)
        self.is_postscore, self.batch_prioritized_routing = bool(is_postscore), bool(batch_prioritized_routing)
        self.normalize_gate, self.is_gshard_loss = bool(normalize_gate), bool(is_gshard_loss)
        self.expert_gradient, self.timer = expert_gradient, timer
        self.dispatch_dtype, self.dispatch_format = dispatch_dtype, dispatch_format(dispatch_dtype)  # format: a2a's
        gate_seed, expert_seed = agreed_seeds(seeds, comm)
        self.experts = flow_class.layout(experts, model_dim, comm, expert_seed, settings)
        self.num_global_experts = self.experts.num_experts
        specs = [gate_type] if isinstance(gate_type, (dict, torch.nn.Module)) else list(gate_type)
        if not specs:
            raise ValueError("gate_type: give at least one gate")
        self.gates = torch.nn.ModuleList(make_gate(spec, model_dim, self.num_global_experts) for spec in specs)
        generator = torch.Generator().manual_seed(gate_seed)
        for gate in self.gates:
            initialize_gate(gate, generator)

        # The dictionary (adaptive=, or parallel_type "adaptive:auto"); Hexa-MoE's flows refuse both.
        hexa = flow_class.name in ("data_centric", "model_centric")
        self.default_r = None if hexa else parse_parallel_type(parallel_type, self.experts.sharers)
        wants_dictionary = not hexa and (adaptive is not None or self.default_r is None)
        self.adaptive = (adaptive or AdaptiveDictionary()) if wants_dictionary else None
        if self.flows:
            check_dictionary_layer(self, flow_class)
        flow_class.check_layer(self)
        if dropless_capacity != "largest" and not flow_class.uses_capacity:
            raise ValueError(f"MoELayer(flow={flow_class.name!r}) routes without a capacity; dropless_capacity="
                             f"{dropless_capacity!r} sizes the capacity of flow='expert' at capacity_factor=0")
        check_dispatch_dtype(self, flow_class, self.flows)

        self._pool = BufferPool()
        self._construction = (flow_class, (parallel_type, a2a_ffn_overlap_degree) if flow_class.name == "expert"
                              else settings, {name: others[name] for name in self.flows})
        self.flow, self._flows = bind_flows(self, comm, *self._construction)
        self.tuning = StepTuning(self.adaptive, timer, timed=any(f.times_steps for f in self._flows.values()))
        self.positions = ExpertPositions(self.num_global_experts, comm.size)
        self.routing_trace: list[np.ndarray] | None = None  # each call appends this rank's (E,) routed counts
        self.l_aux: torch.Tensor | None = None
        self.last_plan: Plan | None = None
        # What more than one rank holds whole (the gates, Hexa-MoE's fc2 bias) takes rank 0's values,
        # whatever each rank's seeds: one model on every rank.
        copy_replicas_from_rank0(self, comm)

    def expert_parallel_settings(self) -> dict[str, tuple[Any, Any]]:
        """Tutel's expert-flow settings of this layer: name -> (value, default)."""
        given = {"parallel_type": self.parallel_type, "a2a_ffn_overlap_degree": self.a2a_ffn_overlap_degree,
                 "use_2dh": self.use_2dh, "adaptive": self.adaptive, "capacity_rule": self.capacity_rule,
                 "dropless_capacity": self.dropless_capacity, "is_postscore": self.is_postscore,
                 "batch_prioritized_routing": self.batch_prioritized_routing, "flows": self.flows}
        return {name: (value, EXPERT_PARALLEL_DEFAULTS[name]) for name, value in given.items()}

    def use_comm(self, comm: a2a.Comm) -> None:
        """Collective: the layer's collectives run on `comm` from now on, a communicator of the same
        ranks in the same order (the CUDA one after ``layer.cuda()``, say). The flows are made anew
        on it; flows that keep state between calls (moe_runtime.binding.REBINDABLE says which do not) refuse."""
        check_rebind(self, comm)
        self.comm = comm
        self.flow, self._flows = bind_flows(self, comm, *self._construction)
        if self.graphs is not None:
            self.graphs.clear()  # captured on the old communicator

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> MoELayer:
        """.to(), .cuda(), .half() ...: the captured steps read the old tensors, so they go."""
        if self.graphs is not None:
            self.graphs.clear()
        return super()._apply(fn, recurse)

    # -- parameters -------------------------------------------------------------
    def shared_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters every rank holds the same copy of (the gates): all-reduce their gradients."""
        return [p for p in self.parameters() if not getattr(p, EXPERT_TAG, False)]

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's expert shards: their gradients are complete already (do not all-reduce)."""
        return [p for p in self.parameters() if getattr(p, EXPERT_TAG, False)]

    def gather_experts(self, *, grad: bool = False) -> dict[str, torch.Tensor]:
        """Every expert whole on every rank (collective): batched_fc1_w (E, H, M),
        batched_fc2_w (E, H, M), batched_fc1_bias (E, H), batched_fc2_bias (E, M),
        indexed by logical expert whatever the placement.
        ``grad=True``: their gradients instead (zeros where there is none)."""
        whole = self.experts.gather_experts(self.comm, grad=grad)
        if self.flex is not None:  # the first slot of each expert
            first = torch.from_numpy(self.flex.first_slots())
            return {name: tensor.index_select(0, first.to(tensor.device)) for name, tensor in whole.items()}
        return self.positions.logical(whole)

    # -- between steps: placement, FlexMoE's slots, Hexa-MoE's prefetch ------------------
    @property
    def placement(self) -> np.ndarray:
        """(W, n) int64: the logical experts each rank holds, slot by slot."""
        return self.positions.placement

    def place(self, assignment: Any, optimizer: torch.optim.Optimizer | None = None) -> Moved:
        """Collective: rank w holds the experts of row w of `assignment` ((W, n),
        every expert once, the same on every rank) from now on. Each expert that
        changes rank is sent once, point to point, with its gradients and, given
        `optimizer`, its state (tensors shaped like the parameter move; scalar
        state such as Adam's step must agree across ranks). The layer's function
        is unchanged: the gate keeps logical ids, mapped to positions at dispatch.
        Returns what this rank sent."""
        if self.graphs is not None:
            self.graphs.clear()  # the captured steps map the gate's choices to the old positions
        return self.positions.place(assignment, self.experts, self.comm, optimizer, self.flow.name)

    def rebalance(self, optimizer: torch.optim.Optimizer | None = None) -> Decision | None:
        """Collective, after the optimizer's step: applies the scheduler's plan
        made at the last call (Expand / Shrink / Migrate of vExpert slots, with
        their gradients and, given `optimizer`, its state). Returns the
        scheduler's Decision (None before any call)."""
        return self._flex_state("rebalance").rebalance(self.experts, optimizer)

    def adjust(self, primitives: Sequence[Primitive], optimizer: torch.optim.Optimizer | None = None) -> Moved:
        """Collective: applies `primitives` (moe_runtime.flex.vexperts: Expand,
        Shrink, Migrate; the same list on every rank) to the vExpert slots,
        their gradients and `optimizer`'s state. Returns what this rank sent."""
        return self._flex_state("adjust").adjust(primitives, self.experts, optimizer)

    def _flex_state(self, method: str):
        if self.flex is None:
            raise ValueError(f"MoELayer.{method} is FlexMoE's: construct the layer with flow=moe_runtime.FlexConfig()")
        return self.flex

    def prefetch(self) -> None:
        """Collective, flow="data_centric" only: starts gathering this layer's experts into the
        pipeline-shared cache on the communication thread (a CUDA side stream on the GPU), so that the
        gather overlaps what the caller runs before the layer's forward; the forward waits for it. Call
        it on every rank at the same point, after the previous data-centric layer's forward. Until the
        forward, the caller makes no MPI call of its own unless MPI granted MPI_THREAD_MULTIPLE. A
        parameter changed since (an optimizer step) makes the forward gather again."""
        if self.parallel != "data_centric":
            raise ValueError(f"MoELayer.prefetch gathers the experts of flow='data_centric' into the "
                             f"pipeline-shared cache; this layer has flow={self.flow.name!r}")
        self.flow.prefetch()

    # -- the call: gate -> agree -> flow -> output ------------------------------------------
    def forward(self, x: torch.Tensor, *, gate_index: int = 0, capacity_factor: float | None = None,
                top_k: int | None = None, a2a_ffn_overlap_degree: int | None = None, adaptive_r: int | None = None,
                algo: str | None = None, flow: str | None = None, sample_ids: Any = None) -> torch.Tensor:
        arguments = {"gate_index": gate_index, "capacity_factor": capacity_factor, "top_k": top_k,
                     "a2a_ffn_overlap_degree": a2a_ffn_overlap_degree, "adaptive_r": adaptive_r, "algo": algo,
                     "flow": flow, "sample_ids": sample_ids}
        return call_in_graphs(self, self._call, x, arguments)  # eager, the caller's graph or ours (common/graphs.py)

    def drop_captured_buffers(self) -> None:
        """Gives back the buffers of the calls captured into the caller's CUDA graphs, once those are gone."""
        self._pool.drop_captured()

    def check(self) -> None:
        """Collective: completes the cross-rank checks that the layer's communicators posted (a2a.Comm.check):
        after capturing the layer into the caller's CUDA graph at W > 1, or at the end of a loop."""
        complete_posted_checks(self)

    def _call(self, x: torch.Tensor, *, gate_index: int, capacity_factor: float | None, top_k: int | None,
              a2a_ffn_overlap_degree: int | None, adaptive_r: int | None, algo: str | None, flow: str | None,
              sample_ids: Any) -> torch.Tensor:
        """The eager call (forward's arguments)."""
        request = Request(adaptive_r, a2a_ffn_overlap_degree, algo, flow, capacity_factor)
        named = self.flow if flow is None else self._flows.get(flow, self.flow)
        # The tokens' model dim and dtype, and this rank's own error, ride in the call's first all-gather:
        # a rank that fails before it still joins it, and every rank raises there (common/agreement.py).
        call = CallFields(x, self.model_dim, f"MoELayer on rank {self.comm.rank}")
        k = 0 if call.error else call.attempt(call_top_k, self, gate_index, top_k, request) or 0
        tokens = call.tokens(x).contiguous().to(compute_dtype(x, self.experts.batched_fc1_w.dtype))
        recording = autograd_records(self, x)
        if recording and self.comm.device == "cuda" and not call.error:
            check_thread_level(self.comm, "torch's autograd engine runs the backward of CUDA tensors (with the "
                                          "layer's collectives)")
        tokens, stop = self.tuning.start(tokens, recording and not call.error, self.training)
        decision, prepared = self._gate(tokens, gate_index, k, request, sample_ids, call)
        capacity, fixed = 0, False
        if decision is not None and named.uses_capacity:
            factor = call.attempt(call_capacity_factor, self.flows, self.gates[gate_index], capacity_factor)
            capacity = 0 if factor is None else call.attempt(self._local_capacity, named, decision, factor) or 0
            fixed = factor is not None and set_by_tokens(factor, self.dropless_capacity)  # known from T alone
        self.flow.settle()  # the flow's own communication in flight (a prefetch) ends before the agreement
        step_seconds = self.tuning.step_seconds  # the previous step's, for FlexMoE; the agreement clears it
        row = CallRow(capacity, k, gate_index, request, tokens.shape[0], self.tuning.seconds_column(),
                      [] if self.adaptive is not None else self.flow.refused(request), call, recording, fixed)
        call_of = functools.partial(Call, tokens, decision, recording=recording, step_seconds=step_seconds,
                                    prepared=prepared)
        run = functools.partial(self._run, request, call_of, x.dtype, k)
        y, self.last_plan = self.flow.context.kept.agree_and_run(row, "MoELayer", self.flow, run)
        y = (y if y.shape == x.shape else y.view(x.shape)).to(x.dtype)
        stop()
        y.l_aux, self.l_aux = decision.l_aux, self.l_aux if recomputing() else decision.l_aux
        return y

    def _run(self, request: Request, call_of: Callable[..., Call], dtype: torch.dtype, k: int, agreed: Agreed,
             values: np.ndarray | None) -> tuple[torch.Tensor, Plan]:
        """The flow at `agreed` and its run; `values`: this rank's row of a fresh agreement (None: kept, or one rank)."""
        self.tuning.agreed(agreed.seconds)
        chosen = self.tuning.choose_for(self, agreed.capacity, dtype, k)
        name = request.flow or (self.flow.name if chosen is None or request.pins else chosen.flow)
        runner = self._flows[name]
        if self.flows:  # the factor was checked to be 0, which every flow computes alike
            request = dataclasses.replace(request, capacity_factor=None)
        choice = runner.configure(request, chosen if chosen is not None and chosen.flow == name else None)
        if values is not None:
            keeps = self.adaptive is None and runner is self.flow and runner.keeps_agreement(choice)
            self.flow.context.kept.record(values, agreed, keeps)
        self.tuning.trial(agreed.capacity, choice.config, choice.timed)
        return runner.run(call_of(choice, agreed.capacity, agreed.token_counts,
                                  recording_anywhere=agreed.recording_anywhere))

    def _gate(self, tokens: torch.Tensor, gate_index: int, k: int, request: Request, sample_ids: Any,
              call: CallFields):
        """The gate's decision (None when this rank failed: ``call.error``), its
        choices mapped to the experts' positions; what the flow began before it
        (the predicted dispatch, whose agreement a failed rank joins too)."""
        prepared = self.flow.begin(tokens, k, sample_ids, request.algo, call)
        decision = None
        try:
            if call.error is None:
                with routing_precision(tokens.device.type):  # the gate in its own dtype (common/precision.py)
                    decision = call.attempt(decide, self.gates[gate_index], tokens, k, training=self.training,
                                            normalize_gate=self.normalize_gate, is_gshard_loss=self.is_gshard_loss)
        finally:
            if prepared is not None:
                prepared.join()  # the predicted dispatch overlapped the gate; it ends before any other collective
        if decision is None:
            return None, prepared
        trace_routing(self.routing_trace, decision.indices, self.num_global_experts)
        if self.positions.moved:
            decision.indices = self.positions.physical(decision.indices)
        return decision, prepared

    def _local_capacity(self, flow: Flow, decision, factor: float) -> int:
        """This rank's capacity for `flow` at capacity factor `factor` (registry.call_capacity_factor's)."""
        return flow.local_capacity(decision, factor, self.capacity_rule, self.dropless_capacity)

    def extra_repr(self) -> str:
        if self.parallel != "expert":
            return (f"flow={self.parallel!r}, model_dim={self.model_dim}, "
                    f"num_global_experts={self.num_global_experts}, world={self.comm.size}")
        return (f"flow={self.flow.name!r}, model_dim={self.model_dim}, num_global_experts={self.num_global_experts}, "
                f"sharded_count={self.experts.sharers}, valid_rs={self.valid_rs}, world={self.comm.size}"
                + (f", flows={self.flows}" if self.flows else ""))
