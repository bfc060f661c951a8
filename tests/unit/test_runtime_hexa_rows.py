"""Hexa-MoE's flows on rows grouped by expert (moe_runtime/hexa/rows.py,
``kernels="grouped"``) against the expert-specific operators (``"es"``), one
rank: the output, the gate's and every expert weight's gradient over two
training steps, with and without biases, in float32 and bfloat16 (torch's
grouped GEMM), in float64 (the loop over the experts), and with experts that
get no rows; which one "auto" runs; where the grouped GEMMs take the rows no
host wait (permute without one, the offsets on the device), bit for bit the
step with permute's wait. Several ranks: tests/mpi_runtime/test_runtime_hexa.py."""

from __future__ import annotations

import pytest
import torch
from checks import counting_alone

import moe_runtime
from moe_runtime.hexa import centric, rows
from moe_runtime.hexa.cache import PipelineSharedCache

M, H, E, T = 32, 48, 4, 40
SETTINGS = {"data_centric": moe_runtime.DataCentric, "model_centric": moe_runtime.ModelCentric}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


def layer_of(comm, flow, kernels, dtype, biases=True, k=2, activation=torch.nn.functional.relu):
    options = {"kernels": kernels}
    if flow == "data_centric":
        options["shared_cache"] = PipelineSharedCache()
    experts = {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H, "activation_fn": activation,
               "has_fc1_bias": biases, "has_fc2_bias": biases}
    layer = moe_runtime.MoELayer({"type": "top", "k": k, "capacity_factor": 0.0}, M, experts, comm=comm,
                                 seeds=(3, 4), flow=SETTINGS[flow](**options))
    return layer.to(dtype)


def train(layer, dtype, steps=2, skew=False):
    """Per step: y, and the gradients of every parameter and of x (an SGD step between)."""
    generator = torch.Generator().manual_seed(11)
    results = []
    for _ in range(steps):
        x = torch.randn(T, M, generator=generator, dtype=torch.float64)
        if skew:  # most tokens to one expert: some experts get no rows
            x += 4 * layer.gates[0].wg.weight.detach().double()[0]
        x = x.to(dtype).requires_grad_(True)
        y = layer(x)
        probe = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape).to(dtype)
        ((y * probe).sum() + y.l_aux).backward()
        grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
        results.append((y.detach(), x.grad.detach(), grads))
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return results


def outputs(step):
    """A step's tensors by name: y, x.grad and every parameter's gradient."""
    y, grad_x, grads = step
    return {"y": y, "x.grad": grad_x, **{f"{name}.grad": g for name, g in grads.items()}}


def relative_error(got, want):
    return (got.double() - want.double()).abs().max().item() / max(want.abs().max().item(), 1e-30)


@pytest.mark.parametrize("flow", sorted(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("biases, activation", [(True, torch.nn.functional.relu), (False, torch.nn.functional.gelu)],
                         ids=["biases-relu", "gelu"])
def test_grouped_rows_compute_what_the_es_operators_do(comm, flow, dtype, biases, activation):
    """float32: torch's grouped GEMM; float64: the loop over the experts (torch has no float64 grouped GEMM)."""
    got = train(layer_of(comm, flow, "grouped", dtype, biases, activation=activation), dtype)
    want = train(layer_of(comm, flow, "es", dtype, biases, activation=activation), dtype)
    for step, (mine, theirs) in enumerate(zip(got, want)):
        mine, theirs = outputs(mine), outputs(theirs)
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert relative_error(mine[name], theirs[name]) <= TOLERANCE[dtype], (name, step)


@pytest.mark.parametrize("flow", sorted(SETTINGS))
@pytest.mark.parametrize("biases", [True, False])
def test_grouped_rows_in_bfloat16_are_as_accurate_as_the_es_operators(comm, flow, biases):
    """In bfloat16 both paths round differently (a relu near 0 may flip), so each is held against the float64
    layer: the grouped path's error at most 1.5x the ES path's, plus 1e-3 of the largest value."""
    reference = train(layer_of(comm, flow, "es", torch.float64, biases), torch.float64)
    got = train(layer_of(comm, flow, "grouped", torch.bfloat16, biases), torch.bfloat16)
    want = train(layer_of(comm, flow, "es", torch.bfloat16, biases), torch.bfloat16)
    for step in range(len(reference)):
        exact, mine, theirs = outputs(reference[step]), outputs(got[step]), outputs(want[step])
        for name in exact:
            ours, es = relative_error(mine[name], exact[name]), relative_error(theirs[name], exact[name])
            assert ours <= 1.5 * es + 1e-3, (name, step, ours, es)


@pytest.mark.parametrize("flow", sorted(SETTINGS))
def test_experts_without_rows(comm, flow):
    """Top-1 with the tokens pushed towards one expert: an expert without rows gets zero weight gradients."""
    got = train(layer_of(comm, flow, "grouped", torch.float32, k=1), torch.float32, steps=1, skew=True)
    want = train(layer_of(comm, flow, "es", torch.float32, k=1), torch.float32, steps=1, skew=True)
    (y, _, grads), (y_want, _, grads_want) = got[0], want[0]
    torch.testing.assert_close(y, y_want, rtol=2e-5, atol=2e-5 * y_want.abs().max().item())
    for name in grads:
        torch.testing.assert_close(grads[name], grads_want[name], rtol=2e-5,
                                   atol=2e-5 * max(grads_want[name].abs().max().item(), 1e-30), msg=name)
    fc1 = grads_want["experts.batched_fc1_w"]
    idle = [e for e in range(E) if not fc1[e].any()]
    assert idle, "the skewed tokens leave some expert without rows"
    for name in ("experts.batched_fc1_w", "experts.batched_fc2_w"):
        for e in idle:
            assert not grads[name][e].any(), (name, e)


@pytest.mark.parametrize("dtype, grouped", [(torch.float32, True), (torch.bfloat16, True), (torch.float64, False)],
                         ids=str)
def test_auto_takes_the_grouped_gemms_where_torch_runs_them(comm, dtype, grouped, monkeypatch):
    """On the CPU torch's grouped GEMM takes float32 and bfloat16 (not float64): "auto" runs on rows there."""
    taken = []
    for flow, function in (("data_centric", "data_centric_rows"), ("model_centric", "model_centric_rows")):
        real = getattr(rows, function)
        monkeypatch.setattr(centric, function, lambda *args, real=real, flow=flow, **kw: taken.append(flow) or real(*args, **kw))
        train(layer_of(comm, flow, "auto", dtype), dtype, steps=1)
    assert taken == (["data_centric", "model_centric"] if grouped else [])
    assert centric.on_rows("auto", torch.zeros(1, 22), 48) is False  # rows of 88 bytes: not a multiple of 16
    assert centric.on_rows("auto", torch.zeros(1, 20), 48) is True  # 80 bytes
    assert centric.on_rows("auto", torch.zeros(1, 20), 50) is False  # hidden rows of 200 bytes
    assert centric.on_rows("grouped", torch.zeros(1, 22, dtype=torch.float64), 50) is True  # asked for: the loop
    assert centric.on_rows("es", torch.zeros(1, 20), 48) is False


def test_kernels_are_checked():
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'es', 'grouped'\), got 'cublas'"):
        moe_runtime.DataCentric(kernels="cublas")
    with pytest.raises(ValueError, match="kernels must be one of"):
        moe_runtime.ModelCentric(kernels=None)


@pytest.mark.parametrize("flow", sorted(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_grouped_rows_wait_for_nothing_where_the_grouped_gemms_take_them(comm, flow, dtype, monkeypatch):
    """float32 and bfloat16: no host wait, and the same bits as with permute's wait and host offsets
    (the same grouped GEMMs); float64 (the loop over the experts): permute's one wait."""
    def step_waits(layer):
        with counting_alone() as cost:
            result = train(layer, dtype, steps=1)
        return result, cost.counters.host_waits

    got, waits = step_waits(layer_of(comm, flow, "grouped", dtype))
    monkeypatch.setattr(rows, "grouped_gemms_take", lambda *args: False)  # permute waits, offsets on the host
    want, waited = step_waits(layer_of(comm, flow, "grouped", dtype))
    assert (waits, waited) == ((1, 1) if dtype == torch.float64 else (0, 1))
    mine, theirs = outputs(got[0]), outputs(want[0])
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
