"""Tutel's ``moe_layer`` over MoELayer: Tutel's constructor, call, attributes
and checkpoint format, every keyword with Tutel's meaning and default.

What differs from MoELayer, and why (docs/runtime.md has the whole table):

- ``group=`` instead of ``comm=``: a torch.distributed group, None for the
  job, or an ``a2a.Comm``; the communicator of each device is made once per
  group (moe/communicator.py) and the layer moves to the one of its tokens'
  device at its first call there (``MoELayer.use_comm``), since Tutel's
  programs build the layer on the CPU and move it afterwards;
- Tutel's defaults: a gate's k = 1 and capacity_factor = 1.0 (or
  ``CAP_FACTOR``); expert gradients summed over the ranks' tokens
  (``expert_gradient="sum"``): the shared parameters' all-reduce is the
  program's;
- ``seeds=(gate, expert, after)``: the gates drawn from the first, this
  rank's experts from the second, then ``torch.manual_seed(after)``;
- Tutel's state_dict: a ``_num_global_experts`` buffer, checked on load,
  and expert tensors of the right size reshaped to the parameter's shape.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

import a2a

from ..flows.expert import positive_degree
from ..gating.custom import custom_gate
from ..layer import MoELayer
from .communicator import communicator, group_size

__all__ = ["TutelMoELayer", "global_expert_count"]

LOG = logging.getLogger(__name__)

# MoELayer's own keywords that the Tutel layer passes on (beyond Tutel's).
EXTENSIONS = ("flow", "flows", "adaptive", "capacity_rule", "dropless_capacity", "cuda_graphs", "expert_gradient",
              "timer")
# Tutel's expert keys, and the ones whose values this layout cannot honour.
EXPERT_KEYS = ("type", "count_per_node", "num_experts_per_device", "hidden_size_per_expert", "activation_fn",
               "activation_fn_with_self", "output_dim", "has_fc1_bias", "has_fc2_bias")


def global_expert_count(num_local_experts: Any, group: Any = None) -> int:
    """Tutel's count of experts: n per rank (n > 0), or one expert per -n
    ranks (n < 0); a fraction f < 1 means -int(1 / f) as in Tutel."""
    if not isinstance(num_local_experts, int):
        num_local_experts = -int(1 / (num_local_experts + 1e-5))
    world = group_size(group)
    if num_local_experts == 0:
        raise ValueError("num_local_experts (num_experts_per_device) must not be 0")
    if num_local_experts > 0:
        return num_local_experts * world
    if world % -num_local_experts != 0:
        raise ValueError(f"num_experts_per_device={num_local_experts}: {-num_local_experts} ranks share an expert, "
                         f"but the group has {world} ranks")
    return world // -num_local_experts


def _gate_specs(gate_type: Any, model_dim: int, count_experts: Callable[[], int], gate_seed: int | None) -> list[Any]:
    """Tutel's gate_type (a dict, a list of them, or the old 'TopKGate') with Tutel's defaults filled in;
    a custom gate built as Tutel builds it (_custom_gate), for count_experts() experts."""
    if isinstance(gate_type, str):
        match = re.fullmatch(r"Top([0-9]+)Gate", gate_type)
        if match is None:
            raise ValueError(f"gate_type {gate_type!r}: give a dict such as {{'type': 'top', 'k': 2}}")
        LOG.warning("gate_type %r is deprecated (Tutel): use {'type': 'top', 'k': %s}", gate_type, match[1])
        gate_type = {"type": "top", "k": int(match[1])}
    specs = [gate_type] if isinstance(gate_type, dict) else list(gate_type)
    filled: list[Any] = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise TypeError(f"gate_type: each gate is a dict such as {{'type': 'top', 'k': 2}}, got {spec!r}")
        if spec.get("type") == "custom":
            filled.append(_custom_gate(spec, model_dim, count_experts(), None if gate_seed is None else gate_seed + index))
            continue
        defaults = {"k": 1, "capacity_factor": float(os.environ.get("CAP_FACTOR", "1.0")), "gate_noise": 0.0}
        if spec.get("type") == "cosine_top":
            defaults["proj_dim"] = 256  # Tutel's (ours otherwise scales it with model_dim)
        filled.append({**defaults, **spec})
    return filled


def _custom_gate(spec: dict[str, Any], model_dim: int, experts: int, seed: int | None) -> torch.nn.Module:
    """Tutel's {'type': 'custom', 'module': cls, **options}: cls(model_dim=, num_global_experts=, **options),
    made after torch.manual_seed(seed) (Tutel's gate seed plus the gate's index) where seeds were given;
    gate_noise and capacity_factor from the options (Tutel's defaults: 0 and CAP_FACTOR or 1) when the
    module sets none."""
    module = spec.get("module")
    if not (isinstance(module, type) and issubclass(module, torch.nn.Module)):
        raise TypeError(f"gate_type {{'type': 'custom'}}: 'module' must be the gate's class (a torch.nn.Module "
                        f"subclass), got {module!r}")
    options = {key: value for key, value in spec.items() if key not in ("type", "module")}
    if seed is not None:
        torch.manual_seed(seed)
    gate = module(model_dim=model_dim, num_global_experts=experts, **options)
    cap_factor = float(os.environ.get("CAP_FACTOR", "1.0"))
    return custom_gate(gate, experts, {"gate_noise": options.get("gate_noise", 0.0),
                                       "capacity_factor": options.get("capacity_factor", cap_factor)})


def _expert_spec(experts: Any, model_dim: int) -> tuple[dict[str, Any], Callable | None]:
    """MoELayer's experts dict from Tutel's (not modified), and Tutel's activation_fn_with_self."""
    if not isinstance(experts, dict):
        raise TypeError(f"experts must be a dict such as {{'type': 'ffn', 'hidden_size_per_expert': H}}, "
                        f"got {type(experts).__name__}")
    if experts.get("type") != "ffn":
        raise ValueError(f"experts type {experts.get('type')!r}: only Tutel's 'ffn' experts are supported (the flows "
                         "move, shard and gather their fc1/fc2 layout); a 'custom' module is not")
    unknown = sorted(set(experts) - set(EXPERT_KEYS))
    if unknown:
        raise ValueError(f"experts: keys {unknown} are not Tutel's ffn experts' ({', '.join(EXPERT_KEYS)})")
    if experts.get("output_dim") not in (None, model_dim):
        raise ValueError(f"experts output_dim={experts['output_dim']}: the experts' output must be model_dim "
                         f"({model_dim}) here")
    with_self = experts.get("activation_fn_with_self")
    if with_self is not None and experts.get("activation_fn") is not None:
        raise ValueError("experts: give activation_fn or activation_fn_with_self, not both (as Tutel)")
    if "count_per_node" in experts and "num_experts_per_device" in experts:
        raise ValueError("experts: give num_experts_per_device or its old name count_per_node, not both")
    spec = {key: value for key, value in experts.items() if key not in ("output_dim", "activation_fn_with_self")}
    if spec.get("num_experts_per_device", spec.get("count_per_node")) == -1:
        spec.pop("count_per_node", None)
        spec["num_experts_per_device"] = 1  # Tutel: -1 means one expert per rank
    return spec, with_self


def _tutel_r(parallel_type: str) -> str:
    """Tutel's parallel_type as MoELayer's: 'adaptive:r' with r < 0 as 0
    (Tutel clamps r to [0, s]; r above s is MoELayer's s already), 'data' as
    r = 1 (Tutel's), 'model' as r = s, 'auto' as r = 1 (Tutel's
    auto-parallel switch is off); 'adaptive:auto' (ours) keeps the dictionary."""
    if parallel_type == "adaptive:auto":
        return parallel_type
    if parallel_type.startswith("adaptive:"):
        try:
            r = int(parallel_type.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"parallel_type {parallel_type!r}: 'adaptive:r' takes an integer r (or ours, "
                             "'adaptive:auto': the dictionary)") from None
        return f"adaptive:{max(r, 0)}"
    if parallel_type == "model":
        return parallel_type
    if parallel_type in ("data", "auto"):  # Tutel's code sets r = 1 for both (its r = 0 is 'adaptive:0')
        return "adaptive:1"
    raise ValueError(f"parallel_type {parallel_type!r}: Tutel's are 'adaptive:r', 'data', 'model' and 'auto'")


class TutelMoELayer(MoELayer):
    """``tutel.moe.moe_layer``: see the module docstring."""

    global_expert_count = staticmethod(global_expert_count)

    def __init__(self, gate_type: Any, model_dim: int, experts: Any = None, scan_expert_func: Callable | None = None,
                 result_func: Callable | None = None, group: Any = None, seeds: Any = None,
                 a2a_ffn_overlap_degree: int = 1, is_postscore: bool = True, batch_prioritized_routing: bool = False,
                 normalize_gate: bool = True, is_gshard_loss: bool = True, parallel_type: str = "adaptive:1",
                 use_2dh: bool = False, **kwargs: Any):
        if kwargs.pop("pad_samples", None) is not None:
            LOG.warning("moe_layer: pad_samples is deprecated (Tutel) and ignored: tokens are never padded")
        unknown = sorted(set(kwargs) - set(EXTENSIONS))
        if unknown:
            raise TypeError(f"moe_layer: unrecognized argument(s) {unknown} (Tutel's moe_layer takes none of them)")
        kwargs.setdefault("expert_gradient", "sum")  # Tutel's: the program averages what it all-reduces
        if not isinstance(model_dim, int) or model_dim % 2:
            raise ValueError(f"model_dim must be an even integer (as Tutel), got {model_dim!r}")
        spec, with_self = _expert_spec(experts, model_dim)
        if int(os.environ.get("BATCH_PRIO", "0")) != 0:
            batch_prioritized_routing = True  # Tutel's switch
        if int(os.environ.get("SKIP_EXPERT", "0")) != 0:
            raise ValueError("SKIP_EXPERT (Tutel's debugging switch: experts return their input) is not supported")
        seeds = tuple(seeds) if seeds is not None else None
        if seeds is not None and not 2 <= len(seeds) <= 3:
            raise ValueError(f"seeds must be (gate_seed, expert_seed[, seed_after]), got {seeds!r}")
        comm = _construction_comm(group)
        gate_seed, expert_seed = _drawn_seeds(seeds)
        local = spec.get("num_experts_per_device", spec.get("count_per_node", 1))
        gates = _gate_specs(gate_type, model_dim, lambda: global_expert_count(local, comm), gate_seed)
        super().__init__(gates, model_dim, spec, comm=comm,
                         seeds=None if gate_seed is None else (gate_seed, expert_seed),
                         parallel_type=_tutel_r(parallel_type), a2a_ffn_overlap_degree=a2a_ffn_overlap_degree,
                         use_2dh=use_2dh, is_postscore=is_postscore, batch_prioritized_routing=batch_prioritized_routing,
                         normalize_gate=normalize_gate, is_gshard_loss=is_gshard_loss, **kwargs)
        self.group, self.result_func = group, result_func
        self.skip_moe = int(os.environ.get("SKIP_MOE", "0")) != 0
        self.register_buffer("_num_global_experts", torch.tensor(self.num_global_experts))
        if with_self is not None:
            self.experts.activation_fn = lambda x: with_self(x, self.experts)
        for name, parameter in self.experts.named_parameters():
            if scan_expert_func is not None:
                scan_expert_func(name, parameter)
            parameter._tutel_expert = True
        # Tutel's r: its parallel_type's, clamped to s as the expert flow clamps it (None: the dictionary's).
        self.adaptive_degree = None if self.default_r is None else min(self.default_r, self.sharded_count)
        # Tutel's names for what its experts and layer hold (its experts' hidden_size is H / s; ours is H).
        self.experts.local_experts, self.experts.sharded_count = self.experts.num_local, self.experts.sharers
        self.experts.hidden_size_per_expert, self.experts.output_dim = self.experts.hidden_size, model_dim
        self.auto_parallel, self.use_model_parallel, self.megablocks_size = False, True, 0
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])

    # -- Tutel's attributes ---------------------------------------------------------------
    num_local_experts = property(lambda self: self.experts.num_local)
    sharded_count = property(lambda self: self.experts.sharers)
    world_size = property(lambda self: self.comm.size)

    def get_parameter_iterator(self, param_type: str):
        """(name, parameter) of the gates ('gate') or this rank's experts ('local_experts')."""
        if param_type == "gate":
            return self.gates.named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"param_type {param_type!r}: the valid ones are 'gate' and 'local_experts'")

    # -- Tutel's checkpoint rules -------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        count = prefix + "_num_global_experts"
        if count not in state_dict:
            LOG.warning("loading a checkpoint without %s (an older Tutel's): the layer's count, %d, is assumed",
                            count, self.num_global_experts)
            state_dict[count] = self._num_global_experts.clone()
        elif int(state_dict[count]) != self.num_global_experts:
            raise ValueError(f"the checkpoint's layer has {int(state_dict[count])} experts, this one "
                             f"{self.num_global_experts} ({count})")
        for name, parameter in self.experts.named_parameters():
            key = prefix + "experts." + name
            if key not in state_dict:
                LOG.warning("the checkpoint has no %s: zeros are loaded into it (as Tutel does)", key)
                state_dict[key] = torch.zeros_like(parameter)
            if state_dict[key].numel() == parameter.numel():
                state_dict[key] = state_dict[key].view(parameter.shape)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- Tutel's call -----------------------------------------------------------------------
    def forward(self, input: torch.Tensor, gate_index: int = 0, capacity_factor: float | None = None,
                top_k: int | None = None, a2a_ffn_overlap_degree: int | None = None, reserve_dims: int = 1,
                inequivalent_tokens: bool = False, adaptive_r: int | None = None, megablocks_size: int = 0,
                **ours: Any) -> torch.Tensor:
        """Tutel's call. a2a_ffn_overlap_degree and adaptive_r stay set for the
        next calls, as in Tutel; inequivalent_tokens changes nothing (the
        capacity is always the maximum over the ranks, which covers ranks of
        different token counts); megablocks_size > 0 gives the result Tutel's
        block-sparse inference gives (the same rows, the padding skipped)."""
        if not isinstance(megablocks_size, int) or megablocks_size < 0:
            raise ValueError(f"megablocks_size must be an integer >= 0, got {megablocks_size!r}")
        self.megablocks_size = megablocks_size
        if self.skip_moe:
            input.l_aux = None
            return self.result_func(input) if self.result_func is not None else input
        if a2a_ffn_overlap_degree is not None:
            self.a2a_ffn_overlap_degree = positive_degree(a2a_ffn_overlap_degree)
        if adaptive_r is not None:
            if adaptive_r not in self.valid_rs:
                raise ValueError(f"adaptive_r={adaptive_r!r}: this layer's valid r are {self.valid_rs}")
            self.adaptive_degree = adaptive_r
        self._follow(input)
        shape = input.shape
        if not 1 <= reserve_dims < len(shape):
            raise ValueError(f"reserve_dims={reserve_dims} must leave a token dimension of the input's {tuple(shape)}")
        tokens = input.reshape(-1, shape[-reserve_dims:].numel())
        # Tutel's r and d stay set call to call; a layer with the dictionary takes them from this call alone.
        pinned = {"adaptive_r": self.adaptive_degree, "a2a_ffn_overlap_degree": self.a2a_ffn_overlap_degree} \
            if self.adaptive is None else {"adaptive_r": adaptive_r, "a2a_ffn_overlap_degree": a2a_ffn_overlap_degree}
        y = super().forward(tokens, gate_index=gate_index, capacity_factor=capacity_factor, top_k=top_k,
                            **pinned, **ours)
        l_aux = y.l_aux
        y = y.view(shape)
        self.protected_shape = y.shape
        y.l_aux = l_aux
        return self.result_func(y) if self.result_func is not None else y

    def _local_capacity(self, flow, decision, factor: float) -> int:
        """Tutel's capacity: the rule's, rounded up to a multiple of s d (of
        128 once past 256) before routing, so that every shard of every
        pipeline chunk gets whole rows; choices within it are kept."""
        capacity = super()._local_capacity(flow, decision, factor)
        return -(-capacity // self.capacity_alignment) * self.capacity_alignment

    @property
    def capacity_alignment(self) -> int:
        """Tutel's rounding of the capacity: s d, to a multiple of 128 past 256."""
        alignment = self.sharded_count * self.a2a_ffn_overlap_degree
        return -(-alignment // 128) * 128 if alignment > 256 else alignment

    def _follow(self, x: torch.Tensor) -> None:
        """Moves the layer to the communicator of its tokens' device (collective, once per move)."""
        if x.device.type != self.comm.device:
            if isinstance(self.group, a2a.Comm):
                raise ValueError(f"the tokens are on {x.device.type} but group is an a2a.Comm for "
                                 f"{self.comm.device} tensors: pass group=None (or a torch group) to let the layer "
                                 "follow its device")
            self.use_comm(communicator(self.group, x.device.type))

    def extra_repr(self) -> str:
        return (f"Top-K(s) = {[f'k={gate.top_k}, noise={gate.gate_noise}' for gate in self.gates]}, "
                f"Total-Experts = {self.num_global_experts} [managed by {self.world_size} device(s)], "
                + super().extra_repr())


def _construction_comm(group: Any) -> a2a.Comm:
    """The communicator the layer is built on (collective): the given
    a2a.Comm; NCCL's for a NCCL group; else the CPU's (MPI's, or under
    torchrun the gloo group's own). The layer moves to its tokens' device at
    the first call."""
    if isinstance(group, a2a.Comm):
        return group
    if _is_nccl(group):
        return communicator(group, "cuda")
    return communicator(group, "cpu")


def _is_nccl(group: Any) -> bool:
    """Whether `group` (or the default group) is a torch.distributed group of the NCCL backend."""
    if isinstance(group, a2a.Comm):
        return False
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return False
    return str(dist.get_backend(group)).lower() == "nccl"


def _drawn_seeds(seeds: tuple | None) -> tuple[int | None, int | None]:
    """MoELayer's (gate_seed, expert_seed) from Tutel's seeds (None: drawn on rank 0)."""
    if seeds is None or seeds[0] is None or seeds[1] is None:
        if seeds is not None and (seeds[0] is None) != (seeds[1] is None):
            raise ValueError(f"seeds {seeds!r}: give both the gate's and the experts' seed, or neither")
        return None, None
    return int(seeds[0]), int(seeds[1])
