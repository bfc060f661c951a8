"""a2a's fused top-k gate (a2a.top_k_gate) on CUDA tensors against the CPU
backend: the same choices (ranked by the logits) and share, the scores,
gates, loss and backward within rounding (the device's expf and the host's
differ by an ulp or two; the order of every sum is the same), in every
dtype; and the forward and backward captured in a CUDA graph and replayed on
new inputs bitwise. Skipped without a GPU or a CUDA build of a2a
(conftest.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_data import DEVICE

import a2a

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,k,normalize", [(1, 1, 1, True), (37, 5, 2, True), (4096, 8, 2, True),
                                                        (3000, 64, 8, False), (300, 256, 6, True)])
def test_gate_on_the_gpu_matches_the_cpu(dtype, tokens, experts, k, normalize):
    g = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64).mul(2).to(dtype)
    d_gates = torch.randn(tokens, k, generator=g, dtype=torch.float64).to(dtype)
    d_l_aux = torch.tensor(0.3, dtype=dtype)
    cpu = a2a.top_k_gate(logits, k, normalize=normalize)
    gpu = a2a.top_k_gate(logits.to(DEVICE), k, normalize=normalize)
    assert torch.equal(gpu[1].cpu(), cpu[1]) and torch.equal(gpu[3].cpu(), cpu[3])
    tol = TOLERANCE[dtype]
    for ours, theirs in zip((gpu[0], gpu[2], gpu[4]), (cpu[0], cpu[2], cpu[4])):
        torch.testing.assert_close(ours.cpu().double(), theirs.double(), rtol=tol, atol=tol)
    cpu_d = a2a.top_k_gate_backward(cpu[0], cpu[1], cpu[3], d_gates, d_l_aux, normalize=normalize)
    gpu_d = a2a.top_k_gate_backward(gpu[0], gpu[1], gpu[3], d_gates.to(DEVICE), d_l_aux.to(DEVICE),
                                    normalize=normalize)
    torch.testing.assert_close(gpu_d.cpu().double(), cpu_d.double(), rtol=tol, atol=tol * cpu_d.abs().max().item())


def test_gate_is_captured_in_a_cuda_graph_and_replayed_bitwise():
    logits = torch.randn(512, 8, device=DEVICE)
    d_gates = torch.randn(512, 2, device=DEVICE)
    d_l_aux = torch.ones((), device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as torch asks
        a2a.top_k_gate(logits, 2, normalize=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = a2a.top_k_gate(logits, 2, normalize=True)
        captured_d = a2a.top_k_gate_backward(captured[0], captured[1], captured[3], d_gates, d_l_aux, normalize=True)
    # New inputs in the captured memory: a replay must compute from them (kernels that ran eagerly during the
    # capture would have left the old results).
    logits.copy_(torch.randn(512, 8, device=DEVICE))
    d_gates.copy_(torch.randn(512, 2, device=DEVICE))
    d_l_aux.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    eager = a2a.top_k_gate(logits, 2, normalize=True)
    eager_d = a2a.top_k_gate_backward(eager[0], eager[1], eager[3], d_gates, d_l_aux, normalize=True)
    for ours, theirs in zip((*captured, captured_d), (*eager, eager_d)):
        assert torch.equal(ours, theirs)
    graph.reset()


def test_a_bad_index_gives_a_row_of_nan_on_the_gpu():
    scores, indices, gates, share, _ = a2a.top_k_gate(torch.randn(6, 4, device=DEVICE), 2)
    bad = indices.clone()
    bad[2, 0] = 9
    d = a2a.top_k_gate_backward(scores, bad, share, gates)
    assert torch.isnan(d[2]).all() and torch.isfinite(d[[0, 1, 3, 4, 5]]).all()
