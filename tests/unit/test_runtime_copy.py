"""copy.deepcopy of a layer (moe_runtime/common/copying.py): an EMA of the
model, a teacher, a second instance, as users copy torch models. The copy
computes what the layer computes, trains on its own, shares the
communicator, and copies none of the last call's state; a communicator and
a low-latency buffer refuse to be pickled, saying why. On several ranks:
tests/mpi_runtime/test_runtime_copies.py."""

from __future__ import annotations

import copy
import pickle

import pytest

import a2a
import moe_runtime

torch = pytest.importorskip("torch")

M, H = 16, 24
FLOWS = {
    "expert": ({}, 4),
    "expert-d2": ({"a2a_ffn_overlap_degree": 2}, 4),
    "dropless": ({"flow": "dropless"}, 4),
    "dynamic": ({"flow": "dynamic"}, 4),
    "expert-cache": ({"flow": moe_runtime.Dropless(expert_cache=moe_runtime.ExpertCache(2))}, 4),
    "low-latency": ({"flow": moe_runtime.Dropless(low_latency_tokens=64)}, 4),
    "flex": ({"flow": "flex"}, 1),
    "data_centric": ({"flow": "data_centric"}, 1),
    "model_centric": ({"flow": "model_centric"}, 1),
    "dictionary": ({"parallel_type": "adaptive:auto"}, 4),
    "fp8": ({"dispatch_dtype": "float8_e4m3fn"}, 4),
}


def make(comm, name):
    options, experts = FLOWS[name]
    return moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, M,
                                {"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": H},
                                comm=comm, seeds=(1, 2), **options)


def tokens(seed: int) -> torch.Tensor:
    return torch.randn(24, M, generator=torch.Generator().manual_seed(seed))


def sgd_step(layer, x) -> None:
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.zero_grad()
    y = layer(x)
    (y.square().mean() + y.l_aux).backward()
    optimizer.step()


@pytest.mark.parametrize("name", list(FLOWS))
def test_a_copy_computes_what_the_layer_computes_and_trains_on_its_own(comm, name):
    layer = make(comm, name)
    fresh = copy.deepcopy(layer)  # before any call
    with torch.no_grad():
        layer(tokens(0))  # inference first: the low-latency path makes its buffer
    sgd_step(layer, tokens(1))
    y = layer(tokens(2))  # a forward whose backward has not run yet
    copied = copy.deepcopy(layer)
    y.sum().backward()
    assert copied.comm is layer.comm and copied.l_aux is None and copied.last_plan is None
    assert all(p is not q for p, q in zip(copied.parameters(), layer.parameters(), strict=True))
    for (key, a), b in zip(layer.state_dict().items(), copied.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    with torch.no_grad():
        before = layer(tokens(3))
        assert torch.equal(copied(tokens(3)), before)
    sgd_step(copied, tokens(4))  # the copy trains; the layer stays as it was
    with torch.no_grad():
        assert torch.equal(layer(tokens(3)), before)
        assert not torch.equal(copied(tokens(3)), before)
    sgd_step(fresh, tokens(1))  # a copy made before the first call trains as the layer would
    twin = make(comm, name)
    sgd_step(twin, tokens(1))
    for (key, a), b in zip(twin.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_a_copy_starts_again_the_dictionary_search_it_was_in(comm):
    layer = make(comm, "dictionary")
    sgd_step(layer, tokens(1))  # the search of this capacity has begun
    capacity = layer.last_plan.capacity
    assert layer.adaptive.tuning(capacity)
    copied = copy.deepcopy(layer)
    assert copied.adaptive is not layer.adaptive and not copied.adaptive.tuning(capacity)
    sgd_step(copied, tokens(1))
    assert copied.adaptive.tuning(capacity) and layer.adaptive.tuning(capacity)


def test_what_cannot_be_copied_says_why(comm):
    assert copy.copy(comm) is comm and copy.deepcopy(comm) is comm
    with pytest.raises(TypeError, match="a2a.Comm cannot be pickled: it is a handle on a live communicator"):
        pickle.dumps(comm)
    with pytest.raises(TypeError, match="a2a.Comm cannot be pickled"):
        torch.save(make(comm, "expert"), __import__("io").BytesIO())
    buffer = a2a.LowLatencyBuffer(comm, 4, 8, 2, 2, dtype="float32")
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="LowLatencyBuffer cannot be copied or pickled: its memory is registered"):
            copier(buffer)


def test_tutels_interface_copies_before_its_first_call_and_after_it():
    from moe_runtime import moe as tutel_moe

    layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=M,
                                experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": H},
                                seeds=(1, 2))
    x = tokens(5).view(4, 6, M)
    before = copy.deepcopy(layer)
    layer(x).sum().backward()
    after = copy.deepcopy(layer)  # after a call too: its l_aux, a tensor of the graph, is not copied
    with torch.no_grad():
        assert torch.equal(before(x), after(x)) and torch.equal(after(x), layer(x))
