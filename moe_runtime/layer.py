"""MoELayer: Tutel's MoE layer interface over a2a, with switchable r,
pipelining degree d, and the dictionary that picks them per capacity.

One call (docs/runtime.md draws the data at every step)::

    x (..., M) -> tokens (T, M)
    gate -> scores (T, E), top-k indices and gates (T, k), l_aux
    capacity: this rank's (Tutel's rule for f > 0 / 0 / < 0), then ONE small
        all-gather agrees on it (max), checks that every rank asked for the
        same r, d, algorithm and k, and carries the previous step's time
    (r, d, algo): the call's arguments, else the dictionary, else the layer's
    routing (a2a.route with the agreed capacity), laid out chunk-major
    fast_encode -> dispatch buffer (d, E, Cd, M)
    flows.run_segment: exchange -> experts -> exchange, d chunks overlapped
    fast_decode -> y (T, M) -> (..., M)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

import a2a
import a2a.torch as a2a_torch

from .common.agreement import CallFields, agree_construction  # ONE-MODEL
from .common.buffers import BufferPool
from .common.host_values import all_gather_values, all_reduce_values
from .common.overlap import Overlap, check_thread_level
from .deployment.assignment_cache import AssignmentCache, AssignmentStats
from .deployment.cached_dispatch import CachedDispatch
from .deployment.dropless import CACHED_WEIGHT_NAMES, dropless_moe
from .deployment.expert_cache import ExpertCache
from .deployment.placement import as_assignment
from .dictionary_flows import check_capacity_factor, check_layer, checked_flows, run_flow
from .dynamic.capacity import CapacityTracker, DynamicCapacity
from .dynamic.ragged import ragged_moe
from .experts.ffn import EXPERT_TAG, FFNExperts
from .experts.relocation import Moved, agree_on_move, move_experts
from .experts.replicas import copy_replicas_from_rank0  # ONE-MODEL
from .flex.config import FlexConfig
from .flex.dispatch import flex_moe
from .flex.scheduler import Decision
from .flex.state import FlexState
from .flex.vexperts import Primitive
from .flows.expert import Plan, Segment, Shape, chunk_major, run_segment
from .gating.capacity import RULES, buffer_capacity, local_capacity
from .gating.gates import decide, make_gate
from .hexa.cache import SHARED_CACHE, PipelineSharedCache
from .hexa.experts import HiddenShardedExperts
from .hexa.flows import data_centric_moe, model_centric_moe
from .layer_fields import layer_fields  # ONE-MODEL
from .tuning.dictionary import FLOWS, AdaptiveDictionary, Config, flow_config

__all__ = ["DISPATCHERS", "PARALLELS", "MoELayer", "sync_shared_gradients"]

DISPATCHERS = ("capacity", "dropless", "dynamic")
PARALLELS = ("expert", "data_centric", "model_centric")  # Tutel's flows; Hexa-MoE's two (moe_runtime.hexa.flows)
_WHOLE_EXPERT_DISPATCHERS = ("dropless", "dynamic")  # r = 1, d = 1, whole experts on every rank

ALGORITHMS = tuple(a2a.ALGORITHMS)
_NONE = -1  # "not given" in the agreement vector
# The agreement vector: one int64 row per rank.
_CAPACITY, _TOP_K, _GATE, _R, _D, _ALGO, _FLOW, _TOKENS, _SECONDS = range(9)
_AGREED_NAMES = {_TOP_K: "top_k", _GATE: "gate_index", _R: "adaptive_r", _D: "a2a_ffn_overlap_degree", _ALGO: "algo",
                 _FLOW: "flow"}


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _parse_parallel_type(parallel_type: str, sharers: int) -> int | None:
    """The default r of a parallel_type; None for the dictionary."""
    if parallel_type in ("auto", "adaptive:auto"):
        return None
    if parallel_type == "data":
        return 0
    if parallel_type == "model":
        return sharers
    if isinstance(parallel_type, str) and parallel_type.startswith("adaptive:"):
        try:
            return int(parallel_type.split(":", 1)[1])
        except ValueError:
            pass
    raise ValueError(
        f"parallel_type must be 'adaptive:<r>', 'adaptive:auto', 'auto', 'data' or 'model', got {parallel_type!r}"
    )


class _StepClock(torch.autograd.Function):
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


class MoELayer(torch.nn.Module):
    """A Mixture-of-Experts layer with Tutel's interface (see the module docstring).

    ``gate_type``: a dict (or a list of them, selected per call by
    ``gate_index``) ``{"type": "top" | "cosine_top", "k", "capacity_factor",
    "gate_noise", "fp32_gate", "z_loss_coef"}``. ``experts``: ``{"type":
    "ffn", "num_experts_per_device": n, "hidden_size_per_expert": H,
    "activation_fn": fn, "has_fc1_bias": True, "has_fc2_bias": True}``; n =
    -s < 0 makes s ranks share one expert. ``comm``: an ``a2a.Comm``.
    ``seeds=(gate_seed, expert_seed)``; None draws them on rank 0. What
    more than one rank holds whole (the gates, Hexa-MoE's fc2 bias) takes
    rank 0's values whatever each rank's seeds (moe_runtime.experts.replicas).

    ``parallel_type``: ``"adaptive:r"`` (default r = 1), ``"data"`` (r = 0),
    ``"model"`` (r = s), ``"adaptive:auto"`` / ``"auto"`` (the dictionary,
    ``adaptive`` or a default :class:`AdaptiveDictionary`). ``flows``: other
    flows for the dictionary to time against the (r, d, algo) of the expert
    flow, once per capacity window, of ``"dropless"``, ``"data_centric"``,
    ``"model_centric"`` (moe_runtime.dictionary_flows: each gathers what it
    needs from the same experts; nothing dropped, so the layer must drop
    nothing either: capacity_factor=0, is_postscore, no batch-prioritized
    routing, num_experts_per_device > 0). ``use_2dh``: the
    default algorithm. ``capacity_rule``: ``"tutel"`` (default) or ``"a2a"``
    (see moe_runtime.gating.capacity). ``expert_gradient``: ``"mean"`` (default:
    expert gradients divided by the world size, as DDP averages the shared
    ones) or ``"sum"``. ``timer``: the clock of the dictionary's trials.
    ``dispatcher``: ``"capacity"`` (default: Tutel's padded buffers, every
    r and d), ``"dropless"`` (moe_runtime.deployment.dropless: nothing dropped or
    padded; r = 1, d = 1, whole experts on every rank) or ``"dynamic"``
    (moe_runtime.dynamic.ragged: one capacity per expert, picked each call by the
    policy of moe_runtime.dynamic.capacity with the settings
    ``dynamic_capacity``, a :class:`DynamicCapacity`; r = 1, d = 1, whole
    experts; ``layer.capacity_tracker`` holds its state). ``expert_cache``: an
    :class:`ExpertCache` (dropless only) that serves calls recording no
    autograd graph (inference): this rank's experts' weights are held on the
    host and only those receiving rows are brought into its device slots.
    ``assignment_cache``: a :class:`moe_runtime.AssignmentCache` (dropless
    dispatcher only): sample-assignment caching for the calls that pass
    ``sample_ids`` (moe_runtime.deployment.cached_dispatch; the same results).
    ``flex``: a :class:`moe_runtime.FlexConfig` (dropless dispatcher only):
    FlexMoE's vExpert replicas of hot experts, routed to locality first;
    ``layer.flex`` holds the table, history and scheduler (moe_runtime.flex.state),
    ``layer.rebalance(optimizer)`` after each optimizer step applies the
    scheduler's plan, ``layer.adjust(primitives, optimizer)`` explicit ones.

    ``parallel``: ``"expert"`` (default: the flows above), or Hexa-MoE's
    ``"data_centric"`` / ``"model_centric"`` (moe_runtime.hexa.flows): every
    expert sharded along its hidden size over every rank
    (moe_runtime.hexa.experts; ``hidden_split``: the ranks' H_w, uniform by
    default, e.g. ``split_by_latency(H, latencies)``), tokens in their order
    through the expert-specific operators, nothing dropped. Data-centric
    gathers the experts whole into the pipeline-shared cache
    (``shared_cache``, moe_runtime.hexa.cache.SHARED_CACHE by default;
    ``layer.prefetch()`` starts that gather early); model-centric all-gathers
    the tokens and reduce-scatters the outputs. Ranks may hold different
    numbers of tokens. Neither takes the expert-parallel settings (dispatcher,
    r, d, algorithm, capacity).

    Call: ``layer(x, capacity_factor=, top_k=, a2a_ffn_overlap_degree=,
    adaptive_r=, algo=, flow=, gate_index=, sample_ids=)`` -> y of x's shape, with
    ``y.l_aux``; ``layer.l_aux`` and ``layer.last_plan`` describe the last
    call, ``layer.assignment_stats`` its caching (None without sample_ids).
    ``sample_ids``: B distinct integers, one per sample; sample i owns tokens
    [i L, (i + 1) L) of x as (T, M), L = T / B (x of shape (B, L, M)).
    ``flow``: runs "expert" or one of the layer's ``flows`` this call instead
    of the dictionary's choice; without it, ``adaptive_r``,
    ``a2a_ffn_overlap_degree`` or ``algo`` pin the expert flow (``algo`` also
    goes with ``flow="dropless"``).
    """

    def __init__(
        self,
        gate_type: dict[str, Any] | Sequence[dict[str, Any]],
        model_dim: int,
        experts: dict[str, Any],
        *,
        comm: a2a.Comm,
        seeds: tuple[int, int] | None = None,
        a2a_ffn_overlap_degree: int = 1,
        is_postscore: bool = True,
        batch_prioritized_routing: bool = False,
        normalize_gate: bool = True,
        is_gshard_loss: bool = True,
        parallel_type: str = "adaptive:1",
        use_2dh: bool = False,
        adaptive: AdaptiveDictionary | None = None,
        capacity_rule: str = "tutel",
        expert_gradient: str = "mean",
        timer: Callable[[], float] = time.perf_counter,
        dispatcher: str = "capacity",
        expert_cache: ExpertCache | None = None,
        dynamic_capacity: DynamicCapacity | None = None,
        assignment_cache: AssignmentCache | None = None,
        flex: FlexConfig | None = None,
        parallel: str = "expert",
        hidden_split: Sequence[int] | None = None,
        shared_cache: PipelineSharedCache | None = None,
        flows: Sequence[str] = (),
    ):
        super().__init__()
        if not isinstance(comm, a2a.Comm):
            raise TypeError(f"comm must be an a2a.Comm, got {type(comm).__name__}")
        if not isinstance(model_dim, int) or isinstance(model_dim, bool) or model_dim <= 0:
            raise ValueError(f"model_dim must be a positive integer, got {model_dim!r}")
        if capacity_rule not in RULES:
            raise ValueError(f"capacity_rule must be one of {RULES}, got {capacity_rule!r}")
        if expert_gradient not in ("mean", "sum"):
            raise ValueError(f"expert_gradient must be 'mean' or 'sum', got {expert_gradient!r}")
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        if parallel not in PARALLELS:
            raise ValueError(f"parallel must be one of {PARALLELS}, got {parallel!r}")
        flows = checked_flows(flows)
        if parallel != "expert":
            _refuse_expert_parallel_options(parallel, {
                "a2a_ffn_overlap_degree": (a2a_ffn_overlap_degree, 1), "is_postscore": (is_postscore, True),
                "batch_prioritized_routing": (batch_prioritized_routing, False),
                "parallel_type": (parallel_type, "adaptive:1"), "use_2dh": (use_2dh, False),
                "adaptive": (adaptive, None), "capacity_rule": (capacity_rule, "tutel"),
                "dispatcher": (dispatcher, "capacity"), "expert_cache": (expert_cache, None),
                "dynamic_capacity": (dynamic_capacity, None), "assignment_cache": (assignment_cache, None),
                "flex": (flex, None), "flows": (flows, ())})
        elif hidden_split is not None:
            raise ValueError("hidden_split= is the setting of parallel='data_centric' or 'model_centric' (experts "
                             "sharded along the hidden size), not of parallel='expert'")
        elif shared_cache is not None and "data_centric" not in flows:
            raise ValueError("shared_cache= is the setting of the data-centric flow: parallel='data_centric', or "
                             "flows= with 'data_centric'")
        if shared_cache is not None and not isinstance(shared_cache, PipelineSharedCache):
            raise TypeError(f"shared_cache must be a moe_runtime.PipelineSharedCache, got {type(shared_cache).__name__}")
        # ONE-MODEL: every rank constructed the layer alike (MismatchError on every rank naming the field),
        # before any other collective of the construction (moe_runtime/common/agreement.py, layer_fields.py).
        agree_construction(comm, "MoELayer", layer_fields(
            gate_type, model_dim, experts, parallel=parallel, dispatcher=dispatcher, flows=flows, flex=flex,
            parallel_type=parallel_type, a2a_ffn_overlap_degree=a2a_ffn_overlap_degree, use_2dh=use_2dh,
            capacity_rule=capacity_rule, expert_gradient=expert_gradient, is_postscore=is_postscore,
            batch_prioritized_routing=batch_prioritized_routing, normalize_gate=normalize_gate,
            is_gshard_loss=is_gshard_loss, dynamic_capacity=dynamic_capacity, adaptive=adaptive,
            assignment_cache=assignment_cache))  # hidden_split: agreed by HiddenShardedExperts itself
        self.parallel = parallel
        self.dispatcher = dispatcher
        self.comm, self.model_dim = comm, model_dim
        self.is_postscore, self.batch_prioritized_routing = bool(is_postscore), bool(batch_prioritized_routing)
        self.normalize_gate, self.is_gshard_loss = bool(normalize_gate), bool(is_gshard_loss)
        self.capacity_rule, self.timer, self.expert_gradient = capacity_rule, timer, expert_gradient
        self.a2a_ffn_overlap_degree = _positive_degree(a2a_ffn_overlap_degree)
        self.default_algo = "2dh" if use_2dh else "linear"

        gate_seed, expert_seed = self._seeds(seeds)
        hexa = parallel != "expert"
        if hexa:  # every expert sharded along H over every rank: no r to choose, nothing to regroup
            self.experts = HiddenShardedExperts(experts, model_dim, comm, expert_seed, hidden_split)
        else:
            self.experts = FFNExperts(experts, model_dim, comm, expert_seed)
        self.num_global_experts = self.experts.num_experts
        self.sharded_count = 1 if hexa else self.experts.sharers
        specs = [gate_type] if isinstance(gate_type, dict) else list(gate_type)
        if not specs:
            raise ValueError("gate_type: give at least one gate")
        self.gates = torch.nn.ModuleList(make_gate(spec, model_dim, self.num_global_experts) for spec in specs)
        generator = torch.Generator().manual_seed(gate_seed)
        for gate in self.gates:
            gate.reset_parameters(generator)

        self.valid_rs = [] if hexa else [0, *_divisors(self.sharded_count)]
        # adaptive_r None: the dictionary (adaptive=, or parallel_type "adaptive:auto") picks (r, d, algo).
        self.adaptive_r = _parse_parallel_type(parallel_type, self.sharded_count)
        if hexa:
            self.adaptive_r = None
        elif self.adaptive_r is not None:
            self.adaptive_r = self._valid_r(self.adaptive_r, "parallel_type")
        if adaptive is not None and not isinstance(adaptive, AdaptiveDictionary):
            raise TypeError(f"adaptive must be a moe_runtime.AdaptiveDictionary, got {type(adaptive).__name__}")
        if not hexa and (adaptive is not None or self.adaptive_r is None):
            self.adaptive = adaptive if adaptive is not None else AdaptiveDictionary()
            self.adaptive_r = None
        else:
            self.adaptive = None

        self.flows = flows
        if flows:
            check_layer(flows, adaptive=self.adaptive is not None, dispatcher=dispatcher, experts=self.experts,
                        is_postscore=self.is_postscore, batch_prioritized_routing=self.batch_prioritized_routing,
                        capacity_factors=[gate.capacity_factor for gate in self.gates], world=comm.size)
        if dispatcher in _WHOLE_EXPERT_DISPATCHERS:
            _check_whole_experts(self)
        if dynamic_capacity is not None and dispatcher != "dynamic":
            raise ValueError(f"dynamic_capacity= is the setting of dispatcher='dynamic', not {dispatcher!r}")
        self.capacity_tracker = None
        if dispatcher == "dynamic":
            self.capacity_tracker = CapacityTracker(dynamic_capacity or DynamicCapacity(), self.num_global_experts)
        if expert_cache is not None and not isinstance(expert_cache, ExpertCache):
            raise TypeError(f"expert_cache must be a moe_runtime.ExpertCache, got {type(expert_cache).__name__}")
        if expert_cache is not None and dispatcher != "dropless":
            raise ValueError("expert_cache needs dispatcher='dropless': the other flows compute every local expert "
                             "(padded buffers), active or not, so there is nothing to leave on the host")
        self.expert_cache = expert_cache
        self._cached_versions: tuple | None = None  # the expert parameters' versions the cache holds
        self.assignment_cache = _checked_assignment_cache(self, assignment_cache)
        self.assignment_stats: AssignmentStats | None = None
        self.flex = None if flex is None else self._make_flex(flex, experts, expert_seed)

        # Communicators, made once (Comm.split is collective): one per group
        # size g > 1 that some r needs, and one for the exchanges, so that a
        # communication thread never shares a communicator with the caller.
        sizes = sorted({self.sharded_count // r for r in self.valid_rs if r >= 1} - {1})
        self._groups = {g: comm.split(comm.rank // g, comm.rank) for g in sizes}
        self._exchange_comm = comm.split(0, comm.rank)
        self._overlap = Overlap(comm.device, comm.cuda_device)
        if assignment_cache is not None:
            check_thread_level(self._exchange_comm, "sample-assignment caching runs the predicted dispatch")
        self._pool = BufferPool()
        self._bound_signature: dict | None = None
        self._trial: tuple[int, Config] | None = None  # (capacity, config) of the step being timed
        self._step_seconds: float | None = None
        self.l_aux: torch.Tensor | None = None
        self.last_plan: Plan | None = None
        # Placement (place()): logical expert e sits at physical position
        # _positions[e] = rank * n + slot, the same table on every rank; the
        # gate's choices are mapped through it before dispatch.
        self._positions = np.arange(self.num_global_experts, dtype=np.int64)
        self._position_table: torch.Tensor | None = None  # _positions on the tokens' device, None for identity
        # A list: each call appends this rank's (E,) counts of routed choices per logical expert.
        self.routing_trace: list[np.ndarray] | None = None
        # The data-centric layers' one full copy of the experts (moe_runtime.hexa.cache).
        self.shared_cache: PipelineSharedCache | None = None
        self._cache_token: int | None = None  # the layer's in the cache
        if parallel == "data_centric" or "data_centric" in flows:
            self.shared_cache = SHARED_CACHE if shared_cache is None else shared_cache
            self._cache_token = self.shared_cache.register(self.experts)
        # ONE-MODEL: what more than one rank holds whole (the gates, Hexa-MoE's fc2 bias) takes rank 0's
        # values, whatever each rank's seeds (moe_runtime/experts/replicas.py).
        copy_replicas_from_rank0(self, comm)

    # -- construction helpers --------------------------------------------------
    def _make_flex(self, config: FlexConfig, spec: dict[str, Any], expert_seed: int) -> FlexState:
        """FlexMoE's state, and the experts again as this rank's vExpert slots."""
        if self.dispatcher != "dropless":
            raise ValueError(f"flex= needs dispatcher='dropless' (FlexMoE routes every choice to a replica), "
                             f"got dispatcher={self.dispatcher!r}")
        if self.expert_cache is not None or self.assignment_cache is not None:
            raise ValueError("flex= does not combine with expert_cache= or assignment_cache= (they assume each "
                             "expert on one rank)")
        experts = self.experts
        state = FlexState(config, comm=self.comm, num_experts=self.num_global_experts,
                          experts_per_rank=experts.num_local, model_dim=self.model_dim, hidden=experts.hidden_size,
                          with_biases=(experts.batched_fc1_bias is not None, experts.batched_fc2_bias is not None),
                          timer=self.timer)
        self.experts = FFNExperts(spec, self.model_dim, self.comm, expert_seed,
                                  slots=state.table.slots[self.comm.rank].tolist())
        return state

    def _seeds(self, seeds: tuple[int, int] | None) -> tuple[int, int]:
        if seeds is None:
            drawn = np.array([int(torch.randint(0, 2**31 - 1, (1,))) for _ in range(2)], dtype=np.int64)
            table = all_gather_values(drawn, self.comm).reshape(self.comm.size, 2)
            return int(table[0, 0]), int(table[0, 1])  # rank 0's
        if len(seeds) != 2:
            raise ValueError(f"seeds must be (gate_seed, expert_seed), got {seeds!r}")
        return int(seeds[0]), int(seeds[1])

    def _valid_r(self, r: int, what: str) -> int:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0:
            raise ValueError(f"{what}: r must be a non-negative integer, got {r!r}")
        r = min(int(r), self.sharded_count)  # Tutel: r above s means s
        if r not in self.valid_rs:
            raise ValueError(f"{what}: r = {r} is not valid for this layer; valid_rs = {self.valid_rs}")
        return r

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
        if self._position_table is None and self.flex is None:
            return whole
        positions = torch.from_numpy(self._positions if self.flex is None else self.flex.first_slots())
        return {name: tensor.index_select(0, positions.to(tensor.device)) for name, tensor in whole.items()}

    # -- placement (the Deployment paper, Section VII; moe_runtime.deployment.placement) --
    @property
    def placement(self) -> np.ndarray:
        """(W, n) int64: the logical experts each rank holds, slot by slot."""
        by_position = np.empty_like(self._positions)
        by_position[self._positions] = np.arange(self._positions.size)
        return by_position.reshape(self.comm.size, -1)

    def place(self, assignment: Any, optimizer: torch.optim.Optimizer | None = None) -> Moved:
        """Collective: rank w holds the experts of row w of `assignment` ((W, n),
        every expert once, the same on every rank) from now on. Each expert that
        changes rank is sent once, point to point, with its gradients and, given
        `optimizer`, its state (tensors shaped like the parameter move; scalar
        state such as Adam's step must agree across ranks). The layer's function
        is unchanged: the gate keeps logical ids, mapped to positions at dispatch.
        Returns what this rank sent."""
        if self.parallel != "expert":
            raise ValueError(f"MoELayer.place moves whole experts, but with parallel={self.parallel!r} every rank "
                             "holds a hidden slice of every expert: there is no placement to choose")
        if self.flex is not None:
            raise ValueError("MoELayer.place: a FlexMoE layer (flex=) places vExpert slots; use adjust() or "
                             "rebalance()")
        if self.experts.sharers > 1:
            raise ValueError(f"MoELayer.place moves whole experts, but {self.experts.sharers} ranks share each of "
                             f"the {self.num_global_experts} experts (num_experts_per_device < 0): there is no "
                             "placement to choose")
        table = np.full(self.num_global_experts, -1, dtype=np.int64)

        def describe() -> bytes:
            table[:] = as_assignment(assignment, self.num_global_experts, self.comm.size).reshape(-1)
            return table.tobytes()

        tensors = agree_on_move(self.comm, f"MoELayer.place on rank {self.comm.rank}", self.experts, optimizer,
                                describe, "assignment")
        new = np.empty_like(self._positions)
        new[table] = np.arange(table.size)
        moved = move_experts(tensors, self._positions, new, self.comm)
        self._positions = new
        identity = (new == np.arange(new.size)).all()
        self._position_table = None if identity else torch.from_numpy(new)
        return moved

    # -- FlexMoE (moe_runtime.flex.state) ----------------------------------------------------
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

    def _flex_state(self, method: str) -> FlexState:
        if self.flex is None:
            raise ValueError(f"MoELayer.{method} is FlexMoE's: construct the layer with flex=moe_runtime.FlexConfig()")
        return self.flex

    # -- the call -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, *, gate_index: int = 0, capacity_factor: float | None = None,
                top_k: int | None = None, a2a_ffn_overlap_degree: int | None = None, adaptive_r: int | None = None,
                algo: str | None = None, flow: str | None = None, sample_ids: Any = None) -> torch.Tensor:
        start = self.timer()
        # ONE-MODEL: the tokens' model dim and dtype ride in the call's first all-gather; a rank whose tokens
        # cannot be routed (call.error) joins it too, and every rank raises there (common/agreement.py).
        call = CallFields(x, self.model_dim, f"MoELayer on rank {self.comm.rank}")
        if not 0 <= gate_index < len(self.gates):
            raise ValueError(f"gate_index {gate_index} is out of range: the layer has {len(self.gates)} gate(s)")
        gate = self.gates[gate_index]
        k = gate.top_k if top_k is None else top_k
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"top_k must be a positive integer, got {k!r}")
        k = min(k, self.num_global_experts)  # as Tutel: k above E means E
        if algo is not None and algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
        if a2a_ffn_overlap_degree is not None:
            a2a_ffn_overlap_degree = _positive_degree(a2a_ffn_overlap_degree)
        if flow is not None and flow not in ("expert", *self.flows):
            raise ValueError(f"flow={flow!r}: this layer's flows are 'expert' and its flows= {self.flows}"
                             if self.flows else f"flow={flow!r} picks one of the flows of a layer constructed with "
                             "flows=(...) (and the dictionary)")

        request = (adaptive_r, a2a_ffn_overlap_degree, algo, flow)
        tokens = call.tokens(x).contiguous()  # ONE-MODEL: was x.reshape(-1, self.model_dim)
        recording = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if recording and self.comm.device == "cuda":
            check_thread_level(self.comm, "torch's autograd engine runs the backward of CUDA tensors (with the "
                                          "layer's collectives)")
        if recording:
            # makes the clock's backward run even if x needs no grad; on the tokens' device, so that autograd
            # sees one device in the clock's inputs
            anchor = torch.zeros((), device=tokens.device, requires_grad=True)
            tokens = _StepClock.apply(tokens, anchor, lambda: self._stop_clock(start))
        caching = self._begin_caching(tokens, k, sample_ids, algo, call)
        try:
            decision = None if call.error else call.attempt(  # ONE-MODEL: was decide(...)
                decide, gate, tokens, k, training=self.training, normalize_gate=self.normalize_gate,
                is_gshard_loss=self.is_gshard_loss)
        finally:
            if caching is not None:
                caching.join()  # the predicted dispatch overlapped the gate; it ends before any other collective
        if decision is None:  # ONE-MODEL
            self._raise_in_agreement(call, k, gate_index, request)
        if self.routing_trace is not None:
            counts = torch.bincount(decision.indices.reshape(-1), minlength=self.num_global_experts)
            self.routing_trace.append(counts.cpu().numpy())
        if self._position_table is not None:  # logical experts -> their positions after place()
            table = self._position_table.to(decision.indices.device)
            decision = dataclasses.replace(decision, indices=table[decision.indices])
        if self.parallel != "expert":
            y = self._hexa(tokens, decision, k, gate_index, request, capacity_factor, call)
        elif self.dispatcher in _WHOLE_EXPERT_DISPATCHERS:
            step_seconds = self._step_seconds  # the previous call's; _agree clears it
            self._agree(0, k, gate_index, request, tokens.shape[0], call)
            if self.flex is not None:
                y = self._flex_call(tokens, decision, request, step_seconds)
            elif self.dispatcher == "dropless":
                y = self._dropless(tokens, decision, request, caching,
                                   cached=self.expert_cache is not None and not recording)
            else:
                y = self._dynamic(tokens, decision, request)
        else:
            factor = gate.capacity_factor if capacity_factor is None else float(capacity_factor)
            check_capacity_factor(self.flows, factor)
            mine = local_capacity(self.capacity_rule, factor, decision.indices, self.num_global_experts)
            capacity, token_counts = self._agree(mine, k, gate_index, request, tokens.shape[0], call)
            config, plan_algo = self._configure(capacity, request, tokens.dtype, k)
            if config.flow == "expert":
                y = self._moe(tokens, decision, capacity, config.r, config.d, plan_algo)
            else:
                y = self._other_flow(config.flow, tokens, decision, capacity, token_counts, plan_algo)
        y = y.view(x.shape)
        if not recording:
            self._stop_clock(start)
        y.l_aux = decision.l_aux
        self.l_aux = decision.l_aux
        return y

    def _moe(self, tokens, decision, capacity: int, r: int, d: int, algo: str) -> torch.Tensor:
        """Routing, encode, the flow of (r, d, algo), decode."""
        experts, num_experts, model_dim = self.experts, self.num_global_experts, self.model_dim
        indices = decision.indices.contiguous()
        scores = decision.scores.detach().contiguous() if self.batch_prioritized_routing else None
        routing = a2a.route(indices, num_experts, capacity=capacity, scores=scores,
                            batch_prioritized=self.batch_prioritized_routing)
        group = self.sharded_count // r if r >= 1 else 1
        rows = buffer_capacity(capacity, d * group)
        chunk_rows = rows // d
        layout = routing
        if rows != capacity or d > 1:
            layout = chunk_major(routing, indices, num_experts, d, chunk_rows, scores)
        # Each exchange sends E r C_b rows in all (blocks of the repeat r), 1/W of them to this rank itself.
        sent = 0 if r == 0 else num_experts * r * rows * (self.comm.size - 1) // self.comm.size
        self.last_plan = Plan(r, d, algo, capacity, rows, routing.num_dropped, sent)

        lease = self._pool.lease()
        buffer = lease.get("dispatch", (d * num_experts, chunk_rows, model_dim), tokens.dtype, tokens.device)
        gates = decision.gates
        dispatched = a2a_torch.fast_encode(tokens, layout, None if self.is_postscore else gates, out=buffer)
        if r == 0:
            gathered_over = self.comm
            fc1, fc1_bias, fc2, fc2_bias = experts.gathered(gathered_over, lease=lease)
            shape = Shape(num_experts, model_dim, num_experts, experts.hidden_size, 1, 1, 1, rows, 0)
        else:
            gathered_over = self._groups.get(group)
            fc1, fc1_bias, fc2, fc2_bias = experts.gathered(gathered_over, lease=lease)
            if r > 1:  # partial outputs: the whole bias is added once, at the tokens' rank
                fc2_bias = experts.fc2_bias(self.comm)
            hidden = experts.hidden_size // r
            shape = Shape(num_experts, model_dim, experts.num_local, hidden, r, group, d, chunk_rows, self.comm.size)
        if d > 1:
            check_thread_level(self._exchange_comm)
        scale = 1.0 / self.comm.size if self.expert_gradient == "mean" else 1.0
        # Weights gathered from other ranks get their gradients in pooled buffers
        # (the gather's backward reduce-scatters them into fresh shard gradients);
        # a rank's own parameters get fresh ones, which autograd keeps as .grad.
        gathered = gathered_over is not None and gathered_over.size > 1
        segment = Segment(shape, self.last_plan, self._exchange_comm, self._overlap, lease, experts.activation_fn,
                          scale, pooled_weight_grads=gathered)
        combined = run_segment(segment, dispatched, fc1, fc1_bias, fc2, fc2_bias)
        # The combine buffer's gradient, as big as the buffer, is pooled too.
        grad_buffer = None
        if combined.requires_grad:
            grad_buffer = lease.get("grad_combine", combined.shape, combined.dtype, combined.device)
        return a2a_torch.fast_decode(combined, layout, gates if self.is_postscore else None, grad_buffer=grad_buffer)

    def _other_flow(self, flow: str, tokens, decision, capacity: int, token_counts: list[int],
                    algo: str) -> torch.Tensor:
        """One of the layer's flows= (moe_runtime.dictionary_flows) on the same experts."""
        scale = 1.0 / self.comm.size if self.expert_gradient == "mean" else 1.0
        y, r, algo, sent = run_flow(flow, tokens, decision.indices, decision.gates, experts=self.experts,
                                    comm=self._exchange_comm, algo=algo, token_counts=token_counts,
                                    cache=self.shared_cache, cache_token=self._cache_token,
                                    weight_grad_scale=scale)
        self.last_plan = Plan(r, 1, algo, capacity, capacity, 0, sent, flow=flow)
        return y

    def prefetch(self) -> None:
        """Collective, parallel="data_centric" only: starts gathering this
        layer's experts into the pipeline-shared cache on the communication
        thread (a CUDA side stream on the GPU), so that the gather overlaps
        what the caller runs before the layer's forward (its attention, say);
        the forward waits for it. Call it on every rank at the same point,
        after the previous data-centric layer's forward. Until the forward,
        the caller makes no MPI call of its own unless MPI granted
        MPI_THREAD_MULTIPLE. A parameter changed since (an optimizer step)
        makes the forward gather again."""
        if self.parallel != "data_centric":
            raise ValueError(f"MoELayer.prefetch gathers the experts of parallel='data_centric' into the "
                             f"pipeline-shared cache; this layer has parallel={self.parallel!r}")
        self.shared_cache.prefetch(self._cache_token, self.experts, self._exchange_comm, self._overlap)

    def _hexa(self, tokens, decision, k: int, gate_index: int, request: tuple,
              capacity_factor: float | None, call: CallFields) -> torch.Tensor:
        """Hexa-MoE's data- or model-centric call (moe_runtime.hexa.flows)."""
        if self.shared_cache is not None:
            # A prefetch runs on the communication thread: done before this thread's next MPI call.
            self.shared_cache.wait()
        r, d, algo, _ = request  # flow= was refused: a layer with parallel= has no flows=
        given = [name for name, value in (("adaptive_r", r), ("a2a_ffn_overlap_degree", d), ("algo", algo),
                                          ("capacity_factor", capacity_factor)) if value is not None]
        counts = self._agree_hexa(tokens.shape[0], k, gate_index, given, call)
        scale = 1.0 / self.comm.size if self.expert_gradient == "mean" else 1.0
        indices, gates = decision.indices, decision.gates
        if self.parallel == "data_centric":
            y = data_centric_moe(tokens, indices, gates, experts=self.experts, cache=self.shared_cache,
                                 token=self._cache_token, comm=self._exchange_comm, weight_grad_scale=scale)
            r, sent = 0, 0
        else:
            y = model_centric_moe(tokens, indices, gates, experts=self.experts, token_counts=counts,
                                  comm=self._exchange_comm, weight_grad_scale=scale)
            r, sent = self.comm.size, tokens.shape[0] * (self.comm.size - 1)
        most = int(max(counts))
        self.last_plan = Plan(r, 1, "linear", most, most, 0, sent, parallel=self.parallel, flow=self.parallel)
        return y

    def _agree_hexa(self, num_tokens: int, k: int, gate_index: int, given: list[str], call: CallFields) -> list[int]:
        """One all-gather: every rank's token count (the uneven collectives'
        counts), a check that every rank asked for the same k and gate, and
        that no rank passed an argument of the expert-parallel flows."""
        row = np.array([num_tokens, k, gate_index, len(given), *call.columns()], dtype=np.int64)  # ONE-MODEL
        table = all_gather_values(row, self.comm).reshape(self.comm.size, len(row))
        call.check(table[:, -CallFields.WIDTH:])  # ONE-MODEL: first, so a mismatch is named before anything else
        self._trial, self._step_seconds = None, None  # no dictionary here
        for column, name in ((1, "top_k"), (2, "gate_index")):
            values = table[:, column]
            if (values != values[0]).any():
                shown = ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))
                raise a2a.MismatchError(f"MoELayer on rank {self.comm.rank}: the ranks passed different {name} "
                                        f"({shown}); every rank must call the layer with the same arguments")
        passing = np.flatnonzero(table[:, 3]).tolist()
        if passing:
            mine = f"; this rank passed {given}" if given else ""
            raise ValueError(f"MoELayer(parallel={self.parallel!r}) on rank {self.comm.rank}: adaptive_r, "
                             f"a2a_ffn_overlap_degree, algo and capacity_factor are the expert-parallel flows' "
                             f"(nothing is dropped or pipelined here), but rank(s) {passing} passed some{mine}")
        return table[:, 0].tolist()

    def _raise_in_agreement(self, call: CallFields, k: int, gate_index: int, request: tuple) -> NoReturn:
        """ONE-MODEL: this rank's tokens cannot be routed (call.error): it joins
        the agreement the other ranks reach with theirs, which raises on every
        rank (common/agreement.py, CallFields.check)."""
        if self.parallel != "expert":
            if self.shared_cache is not None:
                self.shared_cache.wait()  # a prefetch ends before this thread's next MPI call
            self._agree_hexa(0, k, gate_index, [], call)
        else:
            self._agree(0, k, gate_index, request, 0, call)
        raise call.error  # not reached: the agreement raised it

    def _begin_caching(self, tokens, k: int, sample_ids: Any, algo: str | None,
                       call: CallFields) -> CachedDispatch | None:
        """Sample-assignment caching, before the gate (collective when the layer has a cache)."""
        self.assignment_stats = None
        if self.assignment_cache is None:
            if sample_ids is not None:
                raise ValueError("MoELayer: sample_ids are for sample-assignment caching; construct the layer with "
                                 "assignment_cache=moe_runtime.AssignmentCache()")
            return None
        return CachedDispatch.begin(self.assignment_cache, sample_ids, tokens, k, self.num_global_experts,
                                    agree_comm=self.comm, comm=self._exchange_comm, overlap=self._overlap,
                                    algo=self.default_algo if algo is None else algo, call=call)  # ONE-MODEL

    def _dropless(self, tokens, decision, request: tuple, caching: CachedDispatch | None, cached: bool) -> torch.Tensor:
        """The dropless dispatcher (moe_runtime.deployment.dropless): r = 1, d = 1;
        `caching`: the sample-assignment cache's dispatch, begun before the
        gate; `cached`: the experts' weights come from the expert cache."""
        algo, weights, scale = self._whole_expert_call(request)
        indices = decision.indices.contiguous()
        dispatched = None
        if caching is not None:
            dispatched = caching.finish(tokens, indices)
            self.assignment_stats = caching.stats
        y, rows, sent = dropless_moe(tokens, indices, decision.gates, weights=weights,
                                     activation=self.experts.activation_fn, comm=self._exchange_comm, algo=algo,
                                     weight_grad_scale=scale, dispatched=dispatched,
                                     expert_cache=self._bound_cache(tokens.device) if cached else None)
        most = int(rows.max()) if rows.size else 0
        self.last_plan = Plan(1, 1, algo, most, most, 0, sent)
        return y

    def _flex_call(self, tokens, decision, request: tuple, step_seconds: float | None) -> torch.Tensor:
        """FlexMoE's call (moe_runtime.flex.state, flex_dispatch): the plan of
        Algorithm 3 over the vExpert slots, then the dropless flow to it."""
        algo, weights, scale = self._whole_expert_call(request)
        indices = decision.indices.contiguous()
        # A slot's states when it moves: parameters, gradients and (Adam's) two moments.
        state_bytes = 4 * self.flex.expert_elements * weights[0].element_size()
        sends, sync = self.flex.begin(indices, step_seconds, tokens.element_size(), state_bytes, algo)
        y = flex_moe(tokens, indices, decision.gates, sends=sends, weights=weights, sync=sync,
                     activation=self.experts.activation_fn, comm=self._exchange_comm, algo=algo,
                     weight_grad_scale=scale)
        rank = self.comm.rank
        most = int(sends.sum(axis=(0, 1)).max())
        self.last_plan = Plan(1, 1, algo, most, most, 0, int(sends[:, rank, :].sum() - sends[:, rank, rank].sum()))
        return y

    def _dynamic(self, tokens, decision, request: tuple) -> torch.Tensor:
        """The per-expert capacity dispatcher (moe_runtime.dynamic.ragged): r = 1, d = 1,
        capacities from the policy on this call's demand, agreed across ranks."""
        algo, weights, scale = self._whole_expert_call(request)
        indices = decision.indices.contiguous()
        num_experts = self.num_global_experts
        # Each expert's count and the token count, the maximum over ranks: the policy's input.
        counts = torch.bincount(indices[indices >= 0].reshape(-1), minlength=num_experts).cpu().numpy()
        mine = np.append(counts, indices.shape[0]).astype(np.int64)
        agreed = all_reduce_values(mine, self.comm, op="max")
        capacities = self.capacity_tracker.update(agreed[:num_experts], int(agreed[num_experts]), indices.shape[1])
        scores = decision.scores.detach().contiguous() if self.batch_prioritized_routing else None
        y, routing, sent = ragged_moe(tokens, indices, decision.gates, capacities=capacities, weights=weights,
                                      activation=self.experts.activation_fn, comm=self._exchange_comm, algo=algo,
                                      is_postscore=self.is_postscore, scores=scores, weight_grad_scale=scale)
        most = int(capacities.max())
        self.last_plan = Plan(1, 1, algo, most, most, routing.num_dropped, sent,
                              capacities=tuple(routing.capacity.tolist()))
        return y

    def _whole_expert_call(self, request: tuple) -> tuple[str, tuple, float]:
        """(algorithm, this rank's expert weights, gradient scale) of a call of
        the dropless or dynamic dispatcher, after checking its r and d."""
        r, d, algo, _ = request  # flow= was refused: these layers have no flows=
        _require_r1_d1(self.dispatcher, None if r is None else self._valid_r(r, "adaptive_r"), d, "adaptive_r")
        scale = 1.0 / self.comm.size if self.expert_gradient == "mean" else 1.0
        return self.default_algo if algo is None else algo, self.experts.local_weights(), scale

    def _bound_cache(self, device: torch.device) -> ExpertCache:
        """The expert cache holding the current expert weights: (re)bound when
        a parameter changed since (an optimizer step, a load) or the tokens
        moved to another device."""
        cache = self.expert_cache
        named = zip(CACHED_WEIGHT_NAMES, self.experts.local_weights())
        weights = {name: p for name, p in named if p is not None}
        versions = (device, *((p.data_ptr(), p._version) for p in weights.values()))
        if versions != self._cached_versions:
            cache.bind(weights, device)
            self._cached_versions = versions
        return cache

    # -- agreement and the dictionary ------------------------------------------
    def _agree(self, capacity: int, top_k: int, gate_index: int, request: tuple,
               num_tokens: int, call: CallFields) -> tuple[int, list[int]]:
        """One all-gather: the capacity (max over ranks), a check that every rank
        asked for the same things, the previous step's time (max), and every
        rank's token count (the model-centric flow's all_gather_v counts)."""
        r, d, algo, flow = request
        seconds = self._step_seconds
        row = np.array([capacity, top_k, gate_index, _NONE if r is None else int(r), _NONE if d is None else d,
                        _NONE if algo is None else ALGORITHMS.index(algo), _NONE if flow is None else FLOWS.index(flow),
                        num_tokens, _NONE if seconds is None else int(seconds * 1e9),
                        *call.columns()], dtype=np.int64)  # ONE-MODEL: + the tokens' model dim, dtype, failed
        table = all_gather_values(row, self.comm).reshape(self.comm.size, len(row))
        call.check(table[:, -CallFields.WIDTH:])  # ONE-MODEL: first, so a mismatch is named before anything else
        for column, name in _AGREED_NAMES.items():
            values = table[:, column]
            if (values != values[0]).any():
                shown = ", ".join(f"rank {i}: {_shown(column, v)}" for i, v in enumerate(values))
                raise a2a.MismatchError(
                    f"MoELayer on rank {self.comm.rank}: the ranks passed different {name} ({shown}); "
                    "every rank must call the layer with the same arguments"
                )
        times = table[:, _SECONDS]
        if self._trial is not None and (times >= 0).all() and self.adaptive is not None:  # a dictionary's trial
            trial_capacity, config = self._trial
            self.adaptive.report(trial_capacity, config, float(times.max()) / 1e9)
        self._trial, self._step_seconds = None, None
        return int(table[:, _CAPACITY].max()), table[:, _TOKENS].tolist()

    def _configure(self, capacity: int, request: tuple, dtype: torch.dtype, top_k: int) -> tuple[Config, str]:
        """The configuration of this call and its all-to-all algorithm: its
        arguments, else the dictionary's choice, else the layer's defaults.
        Without flow=, adaptive_r, a2a_ffn_overlap_degree and algo pin the
        expert flow (the dictionary's other choice is set aside)."""
        r, d, algo, flow = request
        chosen = None
        if self.adaptive is not None:
            self._bind_dictionary(dtype, top_k)
            chosen = self.adaptive.choose(capacity)
        if flow is None:
            pinned = r is not None or d is not None or algo is not None
            flow = "expert" if chosen is None or pinned else chosen.flow
        if flow != "expert":
            if r is not None or d is not None:
                raise ValueError(f"MoELayer: flow={flow!r} has no r or pipelining degree to choose; adaptive_r and "
                                 "a2a_ffn_overlap_degree are the expert flow's")
            if algo is not None and flow != "dropless":
                raise ValueError(f"MoELayer: flow={flow!r} exchanges no rows by all-to-all; algo is the expert and "
                                 "dropless flows'")
            config = flow_config(flow)
            # A trial runs the layer's default algorithm; another one is a step the user forced.
            self._trial = (capacity, config) if algo in (None, self.default_algo) else None
            return config, self.default_algo if algo is None else algo
        if chosen is not None and chosen.flow == "expert":
            r = chosen.r if r is None else r
            d = chosen.d if d is None else d
            algo = chosen.algo if algo is None else algo
        default_r = 1 if self.adaptive_r is None else self.adaptive_r  # None: the dictionary chose another flow
        r = self._valid_r(default_r if r is None else r, "adaptive_r")
        d = self.a2a_ffn_overlap_degree if d is None else d
        algo = self.default_algo if algo is None else algo
        if r == 0:
            d, algo = 1, "linear"  # no exchange to split or to route
        config = Config(r, d, algo)
        self._trial = (capacity, config)
        return config, algo

    def _bind_dictionary(self, dtype: torch.dtype, top_k: int) -> None:
        comm = self.comm
        signature = {
            "world": comm.size, "local_size": comm.local_size, "num_nodes": comm.num_nodes,
            "experts": self.num_global_experts, "model_dim": self.model_dim,
            "hidden": self.experts.hidden_size, "top_k": top_k, "dtype": str(dtype).removeprefix("torch."),
            "device": comm.device,
        }
        if signature != self._bound_signature:
            two_level = comm.num_nodes > 1 and comm.local_size > 1
            self.adaptive.bind(signature, self.valid_rs, two_level, writer=comm.rank == 0, flows=self.flows)
            self._bound_signature = signature

    def _stop_clock(self, start: float) -> None:
        self._step_seconds = self.timer() - start

    def extra_repr(self) -> str:
        if self.parallel != "expert":
            return (f"parallel={self.parallel!r}, model_dim={self.model_dim}, "
                    f"num_global_experts={self.num_global_experts}, world={self.comm.size}")
        return (f"model_dim={self.model_dim}, num_global_experts={self.num_global_experts}, "
                f"sharded_count={self.sharded_count}, valid_rs={self.valid_rs}, world={self.comm.size}"
                + (f", flows={self.flows}" if self.flows else ""))


def _refuse_expert_parallel_options(parallel: str, options: dict[str, tuple[Any, Any]]) -> None:
    """The data- and model-centric layers take none of the expert-parallel
    flows' settings (options: name -> (value given, default))."""
    given = sorted(name for name, (value, default) in options.items()
                   if value is not default and value != default)
    if given:
        raise ValueError(f"MoELayer(parallel={parallel!r}) shards every expert along the hidden size over every "
                         f"rank and routes every choice (no capacity, no exchange of rows to pipeline or to "
                         f"route); it takes none of {given}")


def _check_whole_experts(layer: MoELayer) -> None:
    """What the dropless and dynamic dispatchers need of the layer, checked at construction."""
    name = f"MoELayer(dispatcher={layer.dispatcher!r})"
    if layer.experts.sharers > 1:
        raise ValueError(
            f"{name} needs whole experts on each rank (E >= W), but "
            f"{layer.experts.sharers} ranks share each of the {layer.num_global_experts} experts; use the "
            "capacity dispatcher for shared experts"
        )
    if layer.adaptive is not None:
        raise ValueError(f"{name} runs r = 1, d = 1: there is nothing for the dictionary "
                         "(adaptive=, parallel_type='adaptive:auto') to choose")
    _require_r1_d1(layer.dispatcher, layer.adaptive_r, layer.a2a_ffn_overlap_degree, "parallel_type r")
    if layer.dispatcher != "dropless":
        return
    if not layer.is_postscore:
        raise ValueError("MoELayer(dispatcher='dropless') applies the gates at the combine: is_postscore must be True")
    if layer.batch_prioritized_routing:
        raise ValueError("MoELayer(dispatcher='dropless') drops nothing, so batch_prioritized_routing (which orders "
                         "who is dropped) has no meaning there")


def _checked_assignment_cache(layer: MoELayer, cache: AssignmentCache | None) -> AssignmentCache | None:
    if cache is None:
        return None
    if not isinstance(cache, AssignmentCache):
        raise TypeError(f"assignment_cache must be a moe_runtime.AssignmentCache, got {type(cache).__name__}")
    if layer.dispatcher != "dropless":
        raise ValueError("assignment_cache needs dispatcher='dropless': the predicted dispatch starts before the "
                         "gate, and the capacity dispatcher's buffers depend on a capacity the gate decides")
    cache.bind(layer)
    return cache


def _require_r1_d1(dispatcher: str, r: int | None, d: int | None, r_name: str) -> None:
    """The dropless and dynamic dispatchers' r and d (None: not given), at construction and per call."""
    if r is not None and r != 1:
        raise ValueError(f"MoELayer(dispatcher={dispatcher!r}) runs r = 1 only, got {r_name}={r}")
    if d is not None and d != 1:
        raise ValueError(f"MoELayer(dispatcher={dispatcher!r}) runs d = 1 only (its rows have no capacity axis "
                         f"to pipeline), got a2a_ffn_overlap_degree={d}")


def _shown(column: int, value: int) -> str:
    if value == _NONE:
        return "not given"
    if column == _FLOW:
        return FLOWS[value]
    return ALGORITHMS[value] if column == _ALGO else str(value)


def _positive_degree(d: Any) -> int:
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
        raise ValueError(f"a2a_ffn_overlap_degree must be a positive integer, got {d!r}")
    return int(d)


def sync_shared_gradients(module: torch.nn.Module, comm: a2a.Comm) -> None:
    """All-reduces (mean over ranks) the gradients of every parameter of
    `module` that is not an expert shard, in one message per dtype, as DDP
    would. Collective: every rank calls it after backward. A missing gradient
    counts as zeros (and is set), so ranks stay in step."""
    shared = [p for p in module.parameters() if not getattr(p, EXPERT_TAG, False)]
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for parameter in shared:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        by_dtype.setdefault(parameter.grad.dtype, []).append(parameter)
    for dtype in sorted(by_dtype, key=str):
        parameters = by_dtype[dtype]
        flat = torch.cat([p.grad.reshape(-1) for p in parameters])
        a2a.all_reduce(flat, comm=comm, out=flat)
        flat /= comm.size
        offset = 0
        for parameter in parameters:
            count = parameter.grad.numel()
            parameter.grad.copy_(flat[offset : offset + count].view_as(parameter.grad))
            offset += count
