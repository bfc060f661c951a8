"""The layers users would pick instead of ours, over one of our layers'
weights: Tutel's ``moe_layer`` and Megatron-Core's ``MoELayer``
(``SequentialMLP`` experts), each where it is installed (``make peers``; on
the GPU machine the kit installs them), on the layer's device and dtype;
and the float64 check that each computes what ours does.

::

    tutel_peer(layer, factor)        Tutel's moe_layer: its state_dict is ours (same names and shapes)
    megatron_peer(layer, factor, dispatcher)
                                     router.weight = our gate's (E, M); local_experts[e].linear_fc1 =
                                     our fc1[e] (H, M), linear_fc2 = our fc2[e] transposed (M, H);
                                     relu, no biases (ours must have none to compare), tokens as
                                     (T, 1, M); f > 0: capacity f with padding (Megatron's static
                                     shapes), f = 0: dropless
    check_peers(comm)                float64, f = 0 (no layer drops anything, so every one computes
                                     sum over the top-k of gate * FFN_e(x)): max |y - y_peer| and
                                     |dx - dx_peer| for loss = sum(y * w), l_aux left out (Megatron's
                                     rides in its graph; its coefficient is 0 here), within 1e-6:
                                     both peers route in float32 whatever the dtype (Tutel's fast
                                     dispatcher takes float32 unless float16, Megatron-Core's softmax
                                     is float32), 4e-8 apart here, where ours is 2e-16 from a float64
                                     loop over the tokens

Megatron-Core needs a torch.distributed group (``start_group``) and its
model-parallel state of one rank. On a CPU its ``alltoall`` dispatcher makes
CUDA streams, so the ``allgather`` one runs there, and a router with the
same linear that leaves its weight where it is (its own moves it to CUDA).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Peer", "PeerAgreement", "check_peers", "failure", "installed_version", "megatron_peer", "peer_builders",
           "start_group", "tutel_peer"]

MISSING = "not installed (make peers)"


@dataclasses.dataclass
class Peer:
    """One peer layer: ``forward(x)`` of (T, M) tokens -> (y (T, M), its
    l_aux or None when the auxiliary loss rides in the graph); or why it
    cannot run here (``missing``)."""

    name: str
    version: str = ""
    module: torch.nn.Module | None = None
    forward: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    missing: str = ""

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """A training step's loss: y.sum(), plus l_aux where it does not ride in the graph (Megatron-Core's does)."""
        y, l_aux = self.forward(x)
        return y.sum() if l_aux is None else y.sum() + l_aux


def installed_version(package: str) -> str:
    """The installed distribution's version, or '?'."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _sizes(layer: Any) -> tuple[int, int, int, int]:
    """(E, M, H, k) of a one-rank layer of whole experts."""
    if layer.comm.size != 1 or layer.experts.sharers != 1:
        raise ValueError("the peers take the weights of a one-rank layer of whole experts")
    return layer.num_global_experts, layer.model_dim, layer.experts.hidden_size, layer.gates[0].top_k


def _place(module: torch.nn.Module, layer: Any) -> torch.nn.Module:
    weight = layer.gates[0].wg.weight
    return module.to(device=weight.device, dtype=weight.dtype)


def tutel_peer(layer: Any, factor: float) -> Peer:
    """Tutel's moe_layer with `layer`'s gate and experts, at capacity factor `factor`."""
    try:
        from tutel import moe as tutel_moe
    except ImportError:
        return Peer("tutel", missing=MISSING)
    num_experts, model_dim, hidden, k = _sizes(layer)
    experts = {"type": "ffn", "count_per_node": num_experts, "hidden_size_per_expert": hidden,
               "activation_fn": torch.nn.functional.relu,  # Tutel's default refers to an unimported name
               "has_fc1_bias": layer.experts.batched_fc1_bias is not None,
               "has_fc2_bias": layer.experts.batched_fc2_bias is not None}
    gate = {"type": "top", "k": k, "capacity_factor": factor, "fp32_gate": layer.gates[0].fp32_gate}
    module = tutel_moe.moe_layer(gate_type=gate, model_dim=model_dim,
                                 experts=experts, seeds=(1, 2, 3))
    module = _place(module, layer)
    module.load_state_dict({name: t for name, t in layer.state_dict().items() if name in module.state_dict()})

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = module(x)
        return y, y.l_aux

    return Peer("tutel", installed_version("tutel"), module, forward)


def megatron_peer(layer: Any, factor: float, dispatcher: str, aux_loss: float = 1e-2,
                  drop_biases: bool = False) -> Peer:
    """Megatron-Core's MoELayer over `layer`'s gate and experts (see the
    module docstring); needs ``start_group()`` first. ``drop_biases``: a layer
    with expert biases gives its weights alone (a peer of the same cost, not
    of the same function: timing only)."""
    try:
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return Peer("megatron-core", missing=MISSING)
    num_experts, model_dim, hidden, k = _sizes(layer)
    biased = layer.experts.batched_fc1_bias is not None or layer.experts.batched_fc2_bias is not None
    if biased and not drop_biases:
        raise ValueError("Megatron-Core's experts have no biases here: give the layer none to compare")
    weight = layer.gates[0].wg.weight

    class PlainRouter(TopKRouter):
        """The router's linear as Megatron-Core computes it without
        Transformer Engine, where its weight is. TopKRouter.gating moves the
        weight to CUDA, and 0.16.1's fallback there names te_general_gemm,
        which is undefined when Transformer Engine is missing (a NameError)."""

        def gating(self, inputs):
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, inputs.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return torch.nn.functional.linear(inputs.to(dtype), self.weight.to(dtype), bias)

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    config = TransformerConfig(
        num_layers=1, hidden_size=model_dim, ffn_hidden_size=hidden, moe_ffn_hidden_size=hidden,
        num_attention_heads=1, num_moe_experts=num_experts, moe_router_topk=k,
        moe_expert_capacity_factor=factor if factor > 0 else None, moe_pad_expert_input_to_capacity=factor > 0,
        moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False, moe_aux_loss_coeff=aux_loss,
        add_bias_linear=False, activation_func=torch.nn.functional.relu, use_cpu_initialization=True,
        params_dtype=weight.dtype, bf16=weight.dtype == torch.bfloat16,
        moe_router_dtype="fp64" if weight.dtype == torch.float64 else None)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp.submodules
    spec = dataclasses.replace(spec, router=PlainRouter)
    module = _place(MoELayer(config, spec), layer)
    fc1, fc2 = layer.experts.batched_fc1_w, layer.experts.batched_fc2_w  # (E, H, M) each
    with torch.no_grad():
        module.router.weight.copy_(weight)
        for e, expert in enumerate(module.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[e])
            expert.linear_fc2.weight.copy_(fc2[e].t())

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, _ = module(x.unsqueeze(1))  # (sequence, batch, hidden)
        return y.squeeze(1), None

    return Peer("megatron-core", megatron.core.__version__, module, forward)


def peer_builders(layer: Any, factor: float, *, aux_loss: float = 1e-2,
                  drop_biases: bool = False) -> tuple[tuple[str, Callable[[], Peer]], ...]:
    """(name, build) of each peer of `layer` at capacity factor `factor`, built
    when called: Megatron-Core's dispatcher is alltoall where the layer is on a
    GPU, allgather on a CPU (see the module docstring)."""
    dispatcher = "alltoall" if layer.gates[0].wg.weight.device.type == "cuda" else "allgather"
    return (("tutel", lambda: tutel_peer(layer, factor)),
            ("megatron-core", lambda: megatron_peer(layer, factor, dispatcher, aux_loss, drop_biases)))


def failure(error: BaseException) -> str:
    """What a peer's row says where it raised: the GPU check runs everything
    in one call, so a peer that breaks there is a row, not the end of the run."""
    return f"failed: {type(error).__name__}: {error}"[:300]


def start_group(device: str) -> Callable[[], None]:
    """A one-process torch.distributed group for the peers (they take the
    default group: gloo on a CPU, NCCL on a GPU); returns what ends it and
    Megatron-Core's state on it. Nothing when a group exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    store = os.path.join(tempfile.mkdtemp(prefix="a2a-peers-"), "store")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)

    def end() -> None:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)

    return end


@dataclasses.dataclass(frozen=True)
class PeerAgreement:
    """How far one peer is from our layer in float64 (see check_peers)."""

    name: str
    version: str
    output_error: float = float("nan")
    grad_error: float = float("nan")
    tolerance: float = 0.0
    missing: str = ""

    @property
    def passed(self) -> bool:
        return not self.missing and max(self.output_error, self.grad_error) <= self.tolerance


def check_peers(comm: Any, *, experts: int = 8, top_k: int = 2, tokens: int = 48, model_dim: int = 16,
                hidden: int = 32, tolerance: float = 1e-6) -> list[PeerAgreement]:
    """Our float64 layer (no biases, one rank, on `comm`'s device) and each
    peer over its weights, on the same tokens at f = 0: how far apart their
    outputs and input gradients are (module docstring). Needs start_group()."""
    from ..common.host_values import torch_device
    from ..layer import MoELayer

    device = torch_device(comm)
    gate = {"type": "top", "k": top_k, "capacity_factor": 0.0, "fp32_gate": False}  # float64 throughout
    layer = MoELayer(gate, model_dim,
                     {"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": hidden,
                      "has_fc1_bias": False, "has_fc2_bias": False},
                     comm=comm, seeds=(11, 12)).to(device=device, dtype=torch.float64)
    generator = torch.Generator(device=device).manual_seed(1000)
    x = torch.randn(tokens, model_dim, dtype=torch.float64, generator=generator, device=device)
    weights = torch.randn(tokens, model_dim, dtype=torch.float64, generator=generator, device=device)

    def run(forward: Callable[[torch.Tensor], Any]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = x.clone().requires_grad_(True)
        y = forward(inputs)[0]
        (y * weights).sum().backward()
        return y.detach(), inputs.grad

    y, dx = run(lambda t: (layer(t), None))
    results = []
    for name, build in peer_builders(layer, 0.0, aux_loss=0.0):
        try:
            peer = build()
            if peer.forward is None:
                results.append(PeerAgreement(peer.name, peer.version, tolerance=tolerance, missing=peer.missing))
                continue
            y_peer, dx_peer = run(peer.forward)
        except Exception as error:  # noqa: BLE001 -- its row says why
            results.append(PeerAgreement(name, "?", tolerance=tolerance, missing=failure(error)))
            continue
        results.append(PeerAgreement(peer.name, peer.version, float((y - y_peer).abs().max()),
                                     float((dx - dx_peer).abs().max()), tolerance))
    return results
