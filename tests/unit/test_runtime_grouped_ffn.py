"""The experts' FFN on ragged rows as grouped GEMMs (moe_runtime/experts/grouped.py)
against the loop over the experts (ragged_ffn.py's fallback): y and every
gradient, with experts that get no rows, biases or not, relu or not, the
layer's weight-gradient scale; and where the grouped GEMM is not used."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.experts import grouped, ragged_ffn
from moe_runtime.experts.ragged_ffn import ragged_ffn as ffn


def run(rows, offsets, weights, activation, scale, use_grouped, monkeypatch):
    """y and the gradients of sum(y * w) through ragged_ffn, grouped or by the loop."""
    if not use_grouped:
        monkeypatch.setattr(ragged_ffn, "grouped_rows", lambda *args: None)
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (rows, *weights)]
    y = ffn(leaves[0], offsets, *leaves[1:], activation, weight_grad_scale=scale)
    probe = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * probe).sum().backward()
    monkeypatch.undo()
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def problem(counts, biases, seed, M=16, H=8):
    """(rows, host offsets, (fc1, fc1_bias, fc2, fc2_bias)) of experts with `counts` rows each."""
    torch.manual_seed(seed)
    n = len(counts)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    weights = (torch.randn(n, H, M), torch.randn(n, H) if biases else None, torch.randn(n, H, M),
               torch.randn(n, M) if biases else None)
    return torch.randn(offsets[-1], M), offsets, weights


@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [12], [0, 0, 9], [3, 0]])
@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("activation", [torch.nn.functional.relu, torch.nn.functional.gelu])
def test_grouped_gemms_compute_what_the_loop_does(counts, biases, activation, monkeypatch):
    rows, offsets, weights = problem(counts, biases, seed=len(counts) + sum(counts))
    assert grouped.grouped_rows(rows, weights[0], weights[2], offsets) is not None
    got = run(rows, offsets, weights, activation, 0.25, True, monkeypatch)
    want = run(rows, offsets, weights, activation, 0.25, False, monkeypatch)
    for name, g, w in zip(("y", "rows", "fc1", "fc1_bias", "fc2", "fc2_bias"), got, want):
        if w is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    for e, count in enumerate(counts):
        if count == 0:
            assert not got[2][e].any() and not got[4][e].any()


@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [0, 0, 9], [3, 0]])
@pytest.mark.parametrize("biases", [True, False])
def test_offsets_on_the_device_give_what_host_offsets_give(counts, biases, monkeypatch):
    rows, offsets, weights = problem(counts, biases, seed=sum(counts))
    on_device = run(rows, torch.tensor(offsets), weights, torch.relu, 0.5, True, monkeypatch)
    on_host = run(rows, offsets, weights, torch.relu, 0.5, True, monkeypatch)
    for name, g, w in zip(("y", "rows", "fc1", "fc1_bias", "fc2", "fc2_bias"), on_device, on_host):
        assert (g is None and w is None) or torch.equal(g, w), name


def test_offsets_on_the_device_without_grouped_gemms_fail_naming_them():
    rows, weight = torch.randn(4, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="only torch's grouped GEMM takes.*float64"):
        ffn(rows, torch.tensor([0, 1, 4]), weight, None, weight, None, torch.relu)


def test_grouped_gemms_in_bfloat16(monkeypatch):
    torch.manual_seed(1)
    offsets = [0, 6, 6, 16]
    rows = torch.randn(16, 16).bfloat16()
    weights = (torch.randn(3, 8, 16).bfloat16(), torch.randn(3, 8).bfloat16(), torch.randn(3, 8, 16).bfloat16(),
               torch.randn(3, 16).bfloat16())
    got = run(rows, offsets, weights, torch.relu, 1.0, True, monkeypatch)
    want = run(rows, offsets, weights, torch.relu, 1.0, False, monkeypatch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_gradients_of_many_rows_in_half_precision(dtype, monkeypatch):
    # Thousands of rows per expert: a sum in bfloat16 itself would stop at 256 (float16: 2048).
    offsets = [0, 3000, 3000, 8192]
    rows = torch.zeros(8192, 16, dtype=dtype)
    weights = (torch.zeros(3, 8, 16, dtype=dtype), torch.ones(3, 8, dtype=dtype), torch.zeros(3, 8, 16, dtype=dtype),
               torch.zeros(3, 16, dtype=dtype))
    for use_grouped in (True, False):
        if not use_grouped:
            monkeypatch.setattr(ragged_ffn, "grouped_rows", lambda *args: None)
        leaves = [t.clone().requires_grad_(True) for t in (rows, *weights)]
        ffn(leaves[0], offsets, *leaves[1:], torch.relu).float().sum().backward()
        monkeypatch.undo()
        want = torch.tensor([3000.0, 0.0, 5192.0]).to(dtype).tolist()  # fc2 bias: rows per expert, rounded once
        assert leaves[4].grad[:, 0].tolist() == want, use_grouped


@pytest.mark.parametrize("case", ["float64", "odd width", "odd hidden", "rows past the last expert", "no rows",
                                  "strided weights"])
def test_the_loop_where_grouped_gemms_do_not_apply(case):
    rows, fc1, offsets = torch.randn(10, 16), torch.randn(2, 8, 16), [0, 4, 10]
    fc2 = torch.randn(2, 8, 16)
    if case == "float64":
        rows, fc1 = rows.double(), fc1.double()
    elif case == "odd width":
        rows, fc1 = torch.randn(10, 6), torch.randn(2, 8, 6)
    elif case == "odd hidden":
        fc1 = torch.randn(2, 6, 16)
    elif case == "rows past the last expert":
        offsets = [0, 4, 8]
    elif case == "no rows":
        rows, offsets = torch.randn(0, 16), [0, 0, 0]
    else:
        fc2 = torch.randn(2, 16, 8).transpose(1, 2)
    assert grouped.grouped_rows(rows, fc1, fc2.to(fc1.dtype), offsets) is None


@pytest.mark.parametrize("flow", ["dropless", "dynamic"])
def test_the_layer_on_grouped_gemms_against_the_float64_reference(comm, flow, monkeypatch):
    """A float32 layer whose ragged flow takes the grouped GEMMs, against moe_reference in float64."""
    import moe_runtime

    used = []
    original = ragged_ffn.grouped_rows

    def counted(*args):
        groups = original(*args)
        used.append(groups is not None)
        return groups

    monkeypatch.setattr(ragged_ffn, "grouped_rows", counted)
    M = 16
    experts = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8}
    layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 0.0}, M, experts, comm=comm,
                                 seeds=(5, 6), flow=flow)
    x = torch.randn(13, M, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = layer(x)
    (y.sum() + y.l_aux).backward()
    assert used and all(used)
    weights = {name: t.double().requires_grad_(True) for name, t in layer.gather_experts().items()}
    wg = layer.gates[0].wg.weight.detach().double().requires_grad_(True)
    xr = x.detach().double().requires_grad_(True)
    (y_ref,), (l_ref,), _ = moe_runtime.moe_reference([xr], wg, weights, top_k=2, capacity_factor=1000.0)
    (y_ref.sum() + l_ref).backward()
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    for name, grad in layer.gather_experts(grad=True).items():
        torch.testing.assert_close(grad.double(), weights[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("use_grouped", [True, False])
def test_the_context_keeps_no_tensor_after_the_backward(use_grouped, monkeypatch):
    """The output's grad_fn (the Function's context) lives as long as the output: after the backward it holds
    neither the hidden activations nor the output (which would be a reference cycle)."""
    if not use_grouped:
        monkeypatch.setattr(ragged_ffn, "grouped_rows", lambda *args: None)
    torch.manual_seed(2)
    rows = torch.randn(12, 16, requires_grad=True)
    fc1, fc2 = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 8, 16, requires_grad=True)
    y = ffn(rows, [0, 5, 12], fc1, None, fc2, None, torch.relu)
    context = y.grad_fn
    assert (context.how.groups is not None) == use_grouped

    def kept_rows():
        """The tensors of 12 rows (the hidden activations (12, 8), the output (12, 16)) the context holds."""
        held = [*vars(context).values(), *vars(context.how).values()]
        if context.how.groups is not None:
            held += vars(context.how.groups).values()
        return [tuple(t.shape) for t in held if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 12]

    assert kept_rows() == []
    y.sum().backward()
    assert kept_rows() == []


def test_the_first_probe_inside_a_cuda_graph_capture_says_to_run_a_step_first(monkeypatch):
    """The probe copies to the device, which a capture refuses: an error saying so, and no answer kept."""
    monkeypatch.setattr(grouped, "_RUNS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="probed at its first use on cuda:0 .*run one step eagerly"):
        grouped.grouped_gemms_run(torch.device("cuda", 0), torch.bfloat16, 64, 64)
    assert grouped._RUNS == {}
