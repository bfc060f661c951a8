"""MoELayer(dispatch_dtype="float8_e4m3fn" / "float8_e5m2"): the tokens
travel to the experts as FP8 rows with block scales.

- Exactly what it computes: the float64 reference layer whose experts see
  the FP8 round trip of the tokens (tests/fp8_reference.py, NumPy, sharing
  no code with a2a), the gate the tokens themselves, the gradient passed
  straight through the quantization: y and every gradient within the float
  tolerance of the plain layer tests, for the expert flow (every r, d in
  {1, 2}, linear and 2dh) and the dropless flow.
- How far that is from the plain layer (the bound docs/moe_kernels.md
  states): the routing is the same, relu is 1-Lipschitz and the gates of a
  token sum to at most 1, so per token
      |y_fp8[t] - y[t]|_2 <= max_e |fc2_e|_2 |fc1_e|_2 * |x^_t - x_t|_2
  with |x^ - x| <= 2^-4 |x| + 2^-10 s + 2^-21 |x| elementwise (e4m3, s the
  block's scale; e5m2: 2^-3 and 2^-17).
- Training: 30 Adam steps on a regression task, FP8 against the tokens'
  dtype: the loss curves within 3% of the first loss at every step.
- Construction errors, on every rank.
"""

from __future__ import annotations

import fp8_reference as fref
import numpy as np
import pytest
import torch
from runtime_util import (
    DEVICE,
    MODEL_DIM,
    NOTHING_DROPS,
    assert_matches,
    experts_spec,
    make_layer,
    on_device,
    reference,
    run_layer,
    tokens_of,
    two_level,
    whole_expert_cases,
)

import a2a
import moe_runtime

FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
BOUNDS = {"e4m3": (2.0**-4, 2.0**-10), "e5m2": (2.0**-3, 2.0**-17)}


def round_trip(fmt: str):
    """x -> x^ (the FP8 round trip of NumPy's reference, of x read as
    float32), the gradient straight through."""

    def expert_inputs(x: torch.Tensor) -> torch.Tensor:
        values = x.detach().cpu().numpy().astype(np.float32)
        codes, scales = fref.quantize(values.reshape(-1, values.shape[-1]), 128, fmt)
        seen = fref.dequantize(codes, scales, 128, fmt).reshape(values.shape)
        seen = torch.from_numpy(seen).to(x.device, x.dtype)
        return x + (seen - x).detach()

    return expert_inputs


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("dispatch_dtype", list(FORMATS))
def test_expert_flow_equals_the_reference_on_the_round_trip(comm, dispatch_dtype, dtype, tolerance):
    num_experts = whole_expert_cases(comm)[0]
    layer = make_layer(comm, num_experts, dtype, dispatch_dtype=dispatch_dtype)
    want = reference(layer, comm, dtype, capacity_factor=1.0, expert_inputs=round_trip(FORMATS[dispatch_dtype]))
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    for r in layer.valid_rs:
        for d in (1, 2):
            for algo in algos:
                what = f"{dispatch_dtype} E={num_experts} r={r} d={d} {algo} {dtype}"
                got = run_layer(layer, comm, dtype, adaptive_r=r, a2a_ffn_overlap_degree=d, algo=algo)
                if r == 0:  # nothing travels: the tokens themselves
                    want_r = reference(layer, comm, dtype, capacity_factor=1.0)
                    assert_matches(got, want_r, tolerance, what)
                else:
                    assert_matches(got, want, tolerance, what)


def test_shared_experts_equal_the_reference_on_the_round_trip(comm):
    """E < W: s ranks share each expert, r up to s (repeat and partial sums)."""
    if comm.size < 2:
        pytest.skip("needs ranks that share an expert")
    layer = make_layer(comm, 1, torch.float64, dispatch_dtype="float8_e4m3fn")
    want = reference(layer, comm, torch.float64, capacity_factor=1.0, expert_inputs=round_trip("e4m3"))
    for r in layer.valid_rs[1:]:
        assert_matches(run_layer(layer, comm, torch.float64, adaptive_r=r), want, 1e-12, f"shared r={r}")


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_the_reference_on_the_round_trip(comm, k):
    algos = ["linear", "2dh"] if two_level(comm) else ["linear"]
    for num_experts in whole_expert_cases(comm):
        layer = make_layer(comm, num_experts, torch.float64, k=k, flow="dropless", dispatch_dtype="float8_e4m3fn")
        want = reference(layer, comm, torch.float64, capacity_factor=NOTHING_DROPS, expert_inputs=round_trip("e4m3"))
        for algo in algos:
            got = run_layer(layer, comm, torch.float64, algo=algo)
            assert_matches(got, want, 1e-12, f"dropless fp8 E={num_experts} k={k} {algo}")


@pytest.mark.parametrize("dispatch_dtype", list(FORMATS))
@pytest.mark.parametrize("flow", ["expert", "dropless"])
def test_within_the_stated_bound_of_the_plain_layer(comm, flow, dispatch_dtype):
    fmt = FORMATS[dispatch_dtype]
    num_experts = whole_expert_cases(comm)[0]
    factor = NOTHING_DROPS if flow == "dropless" else 1.0
    plain = make_layer(comm, num_experts, torch.float64, flow=flow, capacity_factor=factor)
    fp8 = make_layer(comm, num_experts, torch.float64, flow=flow, capacity_factor=factor, dispatch_dtype=dispatch_dtype)
    x = tokens_of(comm.rank, torch.float64)
    y, y8 = plain(x).detach().cpu(), fp8(x).detach().cpu()
    whole = plain.gather_experts()
    norms = [float(torch.linalg.matrix_norm(whole["batched_fc2_w"][e].cpu(), 2) *
                   torch.linalg.matrix_norm(whole["batched_fc1_w"][e].cpu(), 2)) for e in range(num_experts)]
    values = x.cpu().numpy().astype(np.float32)
    _, scales = fref.quantize(values, 128, fmt)
    per_channel = np.repeat(scales, 128, axis=1)[:, : values.shape[1]].astype(np.float64)
    relative, step = BOUNDS[fmt]
    deviation = np.sqrt(((relative + 2.0**-21) * np.abs(values.astype(np.float64)) + step * per_channel) ** 2).sum(1)
    allowed = max(norms) * deviation + 1e-12
    error = torch.linalg.vector_norm(y8 - y, dim=1).numpy()
    assert np.all(error <= allowed), f"rank {comm.rank}: {error} > {allowed}"
    assert np.any(error > 0)  # FP8 did change something: the test can fail


def test_training_loss_follows_the_plain_layers(comm):
    """30 Adam steps of a teacher-student regression (M = 256, two blocks per
    row, H = 64), the same seeds: FP8 dispatch's losses within 3% of the
    first loss of the tokens' dtype at every step."""
    model_dim, steps = 256, 30
    num_experts = 2 * comm.size
    spec = experts_spec(num_experts, comm.size, hidden_size_per_expert=64)
    generator = torch.Generator().manual_seed(5 + comm.rank)
    x = torch.randn(64, model_dim, generator=generator).to(DEVICE)
    teacher = torch.randn(model_dim, model_dim, generator=torch.Generator().manual_seed(9)).to(DEVICE) / 16
    target = torch.tanh(x @ teacher)
    curves = {}
    for dispatch_dtype in (None, "float8_e4m3fn"):
        layer = on_device(moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.5}, model_dim, spec,
                                               comm=comm, seeds=(3, 4), dispatch_dtype=dispatch_dtype),
                          torch.float32)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(layer(x), target)
            loss.backward()
            moe_runtime.sync_shared_gradients(layer, comm)
            optimizer.step()
            losses.append(float(a2a.all_reduce(loss.detach().reshape(1), comm=comm)[0]) / comm.size)  # on the comm's device
        curves[dispatch_dtype] = np.array(losses)
    plain, fp8 = curves[None], curves["float8_e4m3fn"]
    assert plain[-1] < 0.1 * plain[0]  # it learns
    assert np.all(np.abs(fp8 - plain) <= 0.03 * plain[0]), f"{fp8} against {plain}"


@pytest.mark.parametrize("options, message", [
    ({"flow": "flex"}, "flow 'flex' does not carry FP8 rows"),
    ({"is_postscore": False}, "is_postscore must be True"),
    ({"dispatch_dtype": "float8_e3m4"}, "dispatch_dtype must be None"),
], ids=["flex", "prescore", "unknown"])
def test_construction_errors(comm, options, message):
    options = {"dispatch_dtype": "float8_e4m3fn", **options}
    with pytest.raises(ValueError, match=message):
        make_layer(comm, whole_expert_cases(comm)[0], **options)


def test_ranks_that_disagree_raise_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    with pytest.raises(a2a.MismatchError, match="dispatch_dtype"):
        make_layer(comm, whole_expert_cases(comm)[0], dispatch_dtype=None if comm.rank else torch.float8_e4m3fn)
    assert MODEL_DIM == 8
