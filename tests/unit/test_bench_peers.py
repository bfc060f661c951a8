"""moe_runtime.bench.peers: Tutel's and Megatron-Core's layers over our
layer's weights compute what ours does (float64, f = 0, within float32's
1e-6: both route in float32), where they are installed (make peers); where
not, each says so."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime.bench import peers


@pytest.fixture(scope="module")
def group():
    end = peers.start_group("cpu")
    yield
    end()


def test_each_peer_computes_what_ours_does_or_says_it_is_missing(comm, group):
    results = peers.check_peers(comm)
    assert [r.name for r in results] == ["tutel", "megatron-core"]
    for result in results:
        if result.missing:
            assert result.missing == peers.MISSING and not result.passed
            continue
        assert result.passed, result
        assert 0 <= result.output_error <= 1e-6 and 0 <= result.grad_error <= 1e-6


def test_megatron_takes_a_layer_without_biases(comm, group):
    pytest.importorskip("megatron.core", reason="Megatron-Core is not installed (make peers)")
    layer = moe_runtime.MoELayer({"type": "top", "k": 2}, 8, {"type": "ffn", "num_experts_per_device": 2,
                                                               "hidden_size_per_expert": 4}, comm=comm, seeds=(1, 2))
    with pytest.raises(ValueError, match="Megatron-Core's experts have no biases here"):
        peers.megatron_peer(layer, 1.0, "allgather")


def test_a_peer_that_fails_is_a_row_saying_why(comm, group, monkeypatch):
    """On the GPU machine everything runs in one call: a peer that breaks there must not stop the rest."""

    def broken(layer, factor):
        raise RuntimeError("its CUDA extension did not load")

    monkeypatch.setattr(peers, "tutel_peer", broken)
    tutel, megatron = peers.check_peers(comm)
    assert tutel.name == "tutel" and not tutel.passed
    assert tutel.missing == "failed: RuntimeError: its CUDA extension did not load"
    assert megatron.name == "megatron-core" and (megatron.passed or megatron.missing == peers.MISSING)
