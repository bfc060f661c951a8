"""FP8 rows with block scales on CUDA tensors: quantize_fp8 / dequantize_fp8
against the CPU backend, bitwise (moe/fp8.hpp is the element logic of both;
NaN codes are 0x7f on both), a pair's dispatch and exchange on the GPU, the
layer's FP8 dispatch against its CPU twin, and a CUDA graph of the quantize
(no host synchronization). Skipped without a GPU or a CUDA build (conftest.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_data import DEVICE

import a2a

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def values(rows, cols, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.pow(2.0, torch.randint(-30, 30, (rows, 1), generator=gen))
    x[0] = 0
    if rows > 2 and cols > 2:
        x[1, 1], x[2, 2] = float("nan"), float("inf")
    return x.to(dtype)


def gate_safe_tokens(rows, cols, seed):
    """Tokens whose rows span 2^-6..2^6 (FP8 block scales of every size) and
    whose gate scores never tie: a row much smaller than the gate's weights
    (values() has rows down to 2^-30, and a zero row) gives float32 softmax
    scores that are exactly equal, and torch.topk breaks such ties one way
    on the CPU and another on the GPU (the H200 check of 2026-11-30)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.pow(2.0, torch.randint(-6, 7, (rows, 1), generator=gen))


def same_bytes(a, b):
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,block", [(1, 1, 128), (37, 1000, 128), (64, 7168, 128), (5, 300, 100)])
def test_quantize_and_dequantize_match_the_cpu(fmt, dtype, rows, cols, block):
    x = values(rows, cols, dtype)
    cpu = a2a.quantize_fp8(x, block, format=fmt)
    gpu = a2a.quantize_fp8(x.to(DEVICE), block, format=fmt)
    assert gpu[0].device.type == "cuda" and gpu[0].dtype == cpu[0].dtype
    assert same_bytes(gpu.packed, cpu.packed)
    for out_dtype in ("float32", "bfloat16"):
        y_cpu = a2a.dequantize_fp8(*cpu, block=block, dtype=out_dtype)
        y_gpu = a2a.dequantize_fp8(*gpu, block=block, dtype=out_dtype)
        assert torch.equal(torch.isnan(y_gpu.cpu()), torch.isnan(y_cpu))
        finite = ~torch.isnan(y_cpu)
        assert torch.equal(y_gpu.cpu()[finite], y_cpu[finite])


def test_pair_dispatch_and_exchange_on_the_gpu():
    comm = a2a.Comm.from_mpi(device="cuda")
    x = values(64, 1024, torch.bfloat16, seed=1).nan_to_num(0, 0, 0).to(DEVICE)
    indices = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    routing = a2a.route(indices, 4, capacity=40)
    pair = a2a.fast_encode(a2a.quantize_fp8(x), routing)
    cpu_pair = a2a.fast_encode(a2a.quantize_fp8(x.cpu()), a2a.route(indices.cpu(), 4, capacity=40))
    assert same_bytes(pair.packed, cpu_pair.packed)
    received = a2a.all_to_all_flex(pair, comm=comm, split_axis=0, concat_axis=1)
    assert same_bytes(received.packed, cpu_pair.packed.reshape(received.packed.shape))  # one rank: itself


def test_quantize_is_captured_in_a_cuda_graph():
    x = values(128, 1024, torch.bfloat16, seed=3).to(DEVICE)
    out = a2a.quantize_fp8(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a2a.quantize_fp8(x, out=out)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            a2a.quantize_fp8(x, out=out)
    x.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(out.packed, a2a.quantize_fp8(x.cpu()).packed)


@pytest.mark.parametrize("flow", ["expert", "dropless"])
def test_layer_fp8_dispatch_on_the_gpu_matches_the_cpu(flow):
    import moe_runtime

    comm_cpu = a2a.Comm.from_mpi()
    comm_gpu = a2a.Comm.from_mpi(device="cuda")
    spec = {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 256}
    outputs = []
    for comm, device in ((comm_cpu, "cpu"), (comm_gpu, DEVICE)):
        layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, 512, spec, comm=comm,
                                     seeds=(1, 2), flow=flow, dispatch_dtype="float8_e4m3fn").to(device)
        x = gate_safe_tokens(96, 512, seed=4).to(device).requires_grad_()
        y = layer(x)
        y.square().sum().backward()
        with torch.no_grad():
            choices = layer.gates[0].wg(x).topk(2, dim=1).indices.cpu()
        outputs.append((y.detach().cpu(), x.grad.cpu(), choices))
    (y_cpu, g_cpu, chose_cpu), (y_gpu, g_gpu, chose_gpu) = outputs
    # Same choices first: a token rerouted changes which tokens the capacity drops, and then many rows.
    rerouted = (chose_gpu != chose_cpu).any(dim=1).nonzero().flatten().tolist()
    assert not rerouted, f"tokens {rerouted} chose other experts on the GPU (ties in the gate's scores?)"
    # float32 GEMMs summed in another order: an element's error scales with its row's magnitudes, not with
    # its own value (a cancelling element of a 2^6 row differs by ~1e-5 in y, 2026-11-30)
    torch.testing.assert_close(y_gpu, y_cpu, rtol=1e-4, atol=1e-5 * float(y_cpu.abs().max()))
    torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-4, atol=1e-5 * float(g_cpu.abs().max()))


def test_low_latency_round_trip_on_the_gpu_and_in_a_cuda_graph():
    """One rank over NCCL: dispatch then combine equal the CPU buffer's, with
    no wait for the stream; the same two calls captured into a CUDA graph
    and replayed on new tokens; check() reports nothing."""
    comm_cpu = a2a.Comm.from_mpi()
    comm_gpu = a2a.Comm.from_mpi(device="cuda")
    results = []
    for comm, device in ((comm_cpu, "cpu"), (comm_gpu, DEVICE)):
        buffer = a2a.LowLatencyBuffer(comm, 16, 256, 4, 2, "bfloat16", dispatch_dtype="float8_e4m3fn")
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(10, 256, generator=gen).bfloat16().to(device)
        indices = torch.randint(-1, 4, (10, 2), generator=gen).to(device)
        gates = torch.rand(10, 2, generator=gen).to(device)
        expert_x, counts = buffer.dispatch(x, indices)
        y = buffer.combine(expert_x * 2, gates)
        results.append((counts.cpu(), y.float().cpu()))
        if device != "cpu":
            buffer.check()
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)

    buffer = a2a.LowLatencyBuffer(comm_gpu, 16, 256, 4, 2, "float32")
    x = torch.randn(10, 256, device=DEVICE)
    indices = torch.randint(0, 4, (10, 2), device=DEVICE)
    gates = torch.rand(10, 2, device=DEVICE)
    out = torch.empty(buffer.local_experts, buffer.expert_capacity, 256, device=DEVICE)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        expert_x, _ = buffer.dispatch(x, indices)  # warm-up on the capture stream
        out.copy_(expert_x * 3)
        buffer.combine(out, gates)
        with torch.cuda.graph(graph, stream=stream):
            expert_x, _ = buffer.dispatch(x, indices)
            out.copy_(expert_x * 3)
            y = buffer.combine(out, gates)
    x.copy_(torch.randn(10, 256, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    want = 3 * (gates.unsqueeze(2) * x.unsqueeze(1)).sum(dim=1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    buffer.check()
    # The graph before the communicator: NCCL's finalize waits for the work a live graph captured (the
    # communicator's destructor then waits A2A_TIMEOUT_S and aborts; docs/gpu.md, "CUDA graphs").
    graph.reset()
