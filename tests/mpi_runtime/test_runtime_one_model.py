"""One model on every rank, and a configuration every rank agrees on
(moe_runtime.common.agreement, moe_runtime.experts.replicas).

For every layout and flow -- the expert flow with whole and with
shared experts, dropless, dynamic, FlexMoE, Hexa-MoE's data- and
model-centric layers, a layer with flows= under the dictionary -- built with
Tutel's seed convention (a per-rank expert seed) and with a per-rank gate
seed: gather_experts() and every parameter more than one rank holds (the
gates, Hexa-MoE's fc2 bias, FlexMoE's replicas) are bitwise equal on every
rank, the same token gets the same output on every rank, and both still hold
after a training step. A rank constructed with another setting, or called
with tokens of another model dim or dtype, gets a MismatchError naming it on
every rank, at once (no timeout)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from runtime_util import DEVICE, MODEL_DIM, on_device, random_rows, suite_comm, tokens_of, upstream_of

import a2a
import moe_runtime
from moe_runtime.experts.replicas import REPLICATED_TAG, replicated_parameters
from moe_runtime.flex.vexperts import FREE, Expand

HIDDEN = 24  # a multiple of every number of ranks sharing an expert here (2, 3, 4)
DTYPE = torch.float64
TOLERANCE = 1e-12
TIMEOUT_S = 30.0  # the mismatch tests' communicator: a timeout would take this long; a mismatch takes far less


def sharers(world: int) -> int:
    """The ranks that share one expert in the shared layout: W's smallest divisor above 1."""
    return next(s for s in range(2, world + 1) if world % s == 0)


def spec(num_experts_per_device: int, **extra) -> dict:
    return {"type": "ffn", "num_experts_per_device": num_experts_per_device, "hidden_size_per_expert": HIDDEN,
            **extra}


TOP = {"type": "top", "k": 2, "capacity_factor": 1.0}
BOTH_GATES = [TOP, {"type": "cosine_top", "k": 1, "capacity_factor": 1.0}]  # the cosine gate's parameters too
NOTHING_DROPPED = {"type": "top", "k": 2, "capacity_factor": 0.0}


def layouts(world: int) -> dict[str, tuple]:
    """name -> (gate_type, experts, options) of each layout and flow."""
    return {
        "capacity": (BOTH_GATES, spec(2), {}),
        "capacity-shared": (BOTH_GATES, spec(-sharers(world)), {}),
        "dropless": (TOP, spec(2), {"flow": "dropless"}),
        "dynamic": (TOP, spec(2), {"flow": "dynamic"}),
        "flex": (TOP, spec(1), {"flow": moe_runtime.FlexConfig(slots_per_rank=2)}),
        "data_centric": (TOP, spec(1), {"flow": moe_runtime.DataCentric(
            shared_cache=moe_runtime.PipelineSharedCache())}),
        "model_centric": (TOP, spec(1), {"flow": "model_centric"}),
        "flows": (NOTHING_DROPPED, spec(1), {"parallel_type": "adaptive:auto", "flows": (
            "dropless", moe_runtime.DataCentric(shared_cache=moe_runtime.PipelineSharedCache()), "model_centric")}),
    }


SEEDS = {
    "tutel": lambda rank: (1, rank + 1),  # Tutel's helloworld: one gate seed, a per-rank expert seed
    "per-rank-gates": lambda rank: (100 + 7 * rank, rank + 1),
}
LAYOUT_NAMES = list(layouts(4))


def build(comm, layout: str, seeds, **overrides):
    gate_type, experts, options = layouts(comm.size)[layout]
    layer = moe_runtime.MoELayer(gate_type, MODEL_DIM, experts, comm=comm, seeds=seeds, **{**options, **overrides})
    return on_device(layer, DTYPE)


def gathered_bytes(tensor: torch.Tensor, comm) -> torch.Tensor:
    """(W, bytes): every rank's `tensor`, byte for byte."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(DEVICE)
    return a2a.all_gather(data, comm=comm).reshape(comm.size, -1).cpu()


def assert_same_on_every_rank(tensor: torch.Tensor, comm, what: str) -> None:
    rows = gathered_bytes(tensor, comm)
    differ = [rank for rank in range(comm.size) if not torch.equal(rows[rank], rows[0])]
    assert not differ, f"{what}: rank(s) {differ} hold other bytes than rank 0"


def assert_one_model(layer, comm, what: str) -> None:
    """Every expert, every parameter more than one rank holds, FlexMoE's
    replicas: bitwise the same on every rank; and one output for one token."""
    for name, tensor in layer.gather_experts().items():
        assert_same_on_every_rank(tensor, comm, f"{what}: gather_experts()[{name!r}]")
    replicated = {id(parameter) for parameter in replicated_parameters(layer)}
    assert replicated, what  # the gates at least
    for name, parameter in layer.named_parameters():
        if id(parameter) in replicated:
            assert_same_on_every_rank(parameter, comm, f"{what}: {name}")
    if layer.flex is not None:  # every slot of an expert holds the same bytes
        table = layer.flex.table
        for name, parameter in layer.experts.named_parameters():
            slots = gathered_bytes(parameter, comm).reshape(comm.size * table.slots_per_rank, -1)
            for expert in range(table.num_experts):
                where = table.slots_of(expert)
                assert all(torch.equal(slots[s], slots[where[0]]) for s in where), f"{what}: {name} of {expert}"
    x = random_rows(6, 7)  # the same tokens on every rank
    with torch.no_grad():
        y = layer(x)
    ys = a2a.all_gather(y.contiguous(), comm=comm).reshape(comm.size, *y.shape).cpu()
    error = float((ys - ys[0]).abs().max())
    assert error <= TOLERANCE, f"{what}: the same tokens' outputs differ across ranks by {error:.3g}"


@pytest.mark.parametrize("seeds", list(SEEDS))
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_every_rank_holds_one_model_whatever_the_seeds(comm, layout, seeds):
    layer = build(comm, layout, SEEDS[seeds](comm.rank))
    what = f"{layout}, seeds {seeds}"
    if layout == "flex":  # a replica of every expert in the free slots, on other ranks
        table = layer.flex.table
        free = np.flatnonzero(table.slots.reshape(-1) == FREE)  # the next rank's expert in each
        layer.adjust([Expand(int(slot // table.slots_per_rank + 1) % table.num_experts, int(slot)) for slot in free])
        assert layer.flex.table.replica_groups(), what
    if layer.parallel != "expert" and layer.experts.batched_fc2_bias is not None:
        assert getattr(layer.experts.batched_fc2_bias, REPLICATED_TAG, False), what
    assert_one_model(layer, comm, f"{what}, constructed")

    optimizer = torch.optim.Adam(layer.parameters(), lr=0.01)
    for step in range(2):
        x = tokens_of(comm.rank, DTYPE) * (1 + step)  # each rank its own tokens
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        ((y * upstream_of(comm.rank, DTYPE)).sum() + y.l_aux).backward()
        moe_runtime.sync_shared_gradients(layer, comm)
        optimizer.step()
    assert_one_model(layer, comm, f"{what}, trained")


# -- the construction's agreement ---------------------------------------------------------------

DICTIONARY = {"parallel_type": "adaptive:auto", "flows": ("dropless",)}
# (field named, layout, options of every rank, options of rank 1 instead; "experts" / "gate_type" /
# "model_dim" / "default_dtype" replace the layout's). hidden_split is agreed by Hexa-MoE's layout itself
# ("different hidden splits", tests/mpi_runtime/test_runtime_hexa.py).
CONSTRUCTION_CASES = [
    ("model_dim", "capacity", {}, {"model_dim": MODEL_DIM + 4}),
    # A rank whose own checks fail: every rank raises, the mismatch shows that rank's error.
    ("arguments", "capacity", {}, {"capacity_rule": "bogus"}),
    ("arguments", "dropless", {}, {"flow": "sorted"}),
    ("num_experts_per_device", "capacity", {}, {"experts": spec(1)}),
    ("hidden_size_per_expert", "capacity", {}, {"experts": spec(2, hidden_size_per_expert=HIDDEN // 2)}),
    ("has_fc1_bias", "capacity", {}, {"experts": spec(2, has_fc1_bias=False)}),
    ("has_fc2_bias", "model_centric", {}, {"experts": spec(1, has_fc2_bias=False)}),
    ("activation_fn", "capacity", {}, {"experts": spec(2, activation_fn=F.gelu)}),
    ("gate_type", "capacity", {}, {"gate_type": [TOP, {**BOTH_GATES[1], "type": "top"}]}),
    ("k", "dropless", {}, {"gate_type": {**TOP, "k": 1}}),
    ("capacity_factor", "capacity", {}, {"gate_type": [{**TOP, "capacity_factor": 2.0}, BOTH_GATES[1]]}),
    ("gate_options", "dropless", {}, {"gate_type": {**TOP, "fp32_gate": True}}),
    ("dtype", "capacity", {}, {"default_dtype": torch.float64}),
    ("flow", "dropless", {}, {"flow": "dynamic"}),
    ("flow", "model_centric", {}, {"flow": "data_centric"}),
    ("flow_settings", "flex", {}, {"flow": moe_runtime.FlexConfig(slots_per_rank=2, threshold=1.5)}),
    ("flows", "capacity", {**DICTIONARY, "gate_type": NOTHING_DROPPED},
     {"flows": ("dropless", "model_centric")}),
    ("parallel_type", "capacity", {}, {"parallel_type": "adaptive:0"}),
    ("a2a_ffn_overlap_degree", "capacity", {}, {"a2a_ffn_overlap_degree": 2}),
    ("use_2dh", "capacity", {}, {"use_2dh": True}),
    ("capacity_rule", "capacity", {}, {"capacity_rule": "a2a"}),
    ("expert_gradient", "dynamic", {}, {"expert_gradient": "sum"}),
    ("is_postscore", "capacity", {}, {"is_postscore": False}),
    ("batch_prioritized_routing", "capacity", {}, {"batch_prioritized_routing": True}),
    ("flow_settings", "dynamic", {}, {"flow": moe_runtime.DynamicCapacity(margin=1.5)}),
    ("adaptive", "capacity", {}, {"adaptive": moe_runtime.AdaptiveDictionary()}),
    ("flow_settings", "dropless", {}, {"flow": moe_runtime.Dropless(assignment_cache=moe_runtime.AssignmentCache())}),
]


def construct(comm, layout, options):
    gate_type, experts, layout_options = layouts(comm.size)[layout]
    options = dict(options)
    gate_type = options.pop("gate_type", gate_type)
    experts = options.pop("experts", experts)
    model_dim = options.pop("model_dim", MODEL_DIM)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(options.pop("default_dtype", default_dtype))
    try:
        return moe_runtime.MoELayer(gate_type, model_dim, experts, comm=comm, seeds=(1, 2),
                                    **{**layout_options, **options})
    finally:
        torch.set_default_dtype(default_dtype)


@pytest.mark.parametrize("field, layout, everyone, rank1", CONSTRUCTION_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CONSTRUCTION_CASES])
def test_a_rank_constructed_otherwise_fails_on_every_rank_naming_the_field(comm, field, layout, everyone, rank1):
    if comm.size < 2:
        pytest.skip("needs another rank")
    construct(comm, layout, everyone)  # valid on every rank, as every rank builds it
    options = {**everyone, **rank1} if comm.rank == 1 else everyone
    with pytest.raises(a2a.MismatchError) as caught:
        construct(comm, layout, options)
    message = str(caught.value)
    assert message.startswith(f"MoELayer on rank {comm.rank}: the ranks were constructed with different "), message
    values = message.split(f" {field} (rank 0: ", 1)
    assert len(values) == 2, message
    assert all(f", rank {rank}: " in values[1] for rank in range(1, comm.size)), message  # each rank's value
    construct(comm, layout, everyone)  # the ranks are still in step


# -- the call's agreement ------------------------------------------------------------------------

CALL_LAYOUTS = [*LAYOUT_NAMES, "assignment_cache"]


@pytest.fixture(scope="module")
def bounded_comm(world):
    """The mismatch tests' communicator: a timeout there would take TIMEOUT_S."""
    return suite_comm(world, timeout_s=TIMEOUT_S)


def call_layer(comm, layout):
    if layout == "assignment_cache":
        return build(comm, "dropless", (1, 2), flow=moe_runtime.Dropless(assignment_cache=moe_runtime.AssignmentCache()))
    return build(comm, layout, (1, 2))


def call_once(layer, x, layout, comm):
    if layout == "assignment_cache":
        return layer(x, sample_ids=np.arange(x.shape[0]) + 1000 * comm.rank)
    return layer(x)


@pytest.mark.parametrize("field", ["model_dim", "dtype", "dtype of layer and tokens"])
@pytest.mark.parametrize("layout", CALL_LAYOUTS)
def test_a_call_with_other_tokens_on_one_rank_fails_on_every_rank_naming_the_field(bounded_comm, layout, field):
    comm = bounded_comm
    if comm.size < 2:
        pytest.skip("needs another rank")
    layer = call_layer(comm, layout)
    x = tokens_of(comm.rank, DTYPE)
    if comm.rank == 1:
        if field == "model_dim":  # this rank's gate cannot take them: it joins the agreement all the same
            x = random_rows(x.shape[0], 5, columns=MODEL_DIM + 1)
        elif field == "dtype":  # nor these
            x = x.float()
        else:  # a layer and tokens of another dtype: they go through the gate
            layer.float()
            x = x.float()
    start = time.monotonic()
    with pytest.raises(a2a.MismatchError) as caught:
        call_once(layer, x, layout, comm)
    seconds = time.monotonic() - start
    name = "model_dim" if field == "model_dim" else "dtype"
    message = str(caught.value)
    assert f"MoELayer on rank {comm.rank}: the ranks passed tokens of different {name} (rank 0: " in message, message
    assert all(f"rank {rank}: " in message for rank in range(comm.size)), message
    if field != "model_dim":
        assert "rank 1: torch.float32" in message and "rank 0: torch.float64" in message, message
    assert seconds < TIMEOUT_S / 3, f"{layout}: the mismatch took {seconds:.1f} s"
    # The ranks are still in step: the next call, alike everywhere, runs.
    layer = layer.to(DTYPE)
    y = call_once(layer, tokens_of(comm.rank, DTYPE), layout, comm)
    assert y.shape == tokens_of(comm.rank, DTYPE).shape


def test_a_wrong_model_dim_on_every_rank_is_each_rank_s_own_error(bounded_comm):
    layer = call_layer(bounded_comm, "capacity")
    with pytest.raises(ValueError, match=rf"MoELayer on rank {bounded_comm.rank}: input \(3, 9\) must end with "
                                         rf"model_dim {MODEL_DIM}"):
        layer(random_rows(3, 5, columns=MODEL_DIM + 1))
    layer(tokens_of(bounded_comm.rank, DTYPE))
