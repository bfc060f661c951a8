"""moe_runtime.MoELayer on a CUDA communicator (1 rank, NCCL and staged MPI):
its control values (the agreement all-gather) through the GPU, one training
step equal to the same layer on the host communicator, training steps that
make no synchronizing torch call (f > 0, the worst-case f = 0, dropless),
and the GShard peer of python -m moe_runtime.bench agreeing with the layer
there. Skipped without a GPU or a CUDA build of a2a."""

from __future__ import annotations

import numpy as np
import pytest

import a2a

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=["nccl", "mpi"])
def cuda_comm(request, cuda_available):
    from mpi4py import MPI

    if request.param == "nccl" and not a2a.config()["nccl"]:
        pytest.skip("a2a was built without NCCL (a2a.config()['nccl'] is False)")
    return a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda", transport=request.param)


@pytest.fixture(scope="module")
def host_comm():
    from mpi4py import MPI

    return a2a.Comm.from_mpi(MPI.COMM_SELF)


def test_host_values_travel_through_the_gpu(cuda_comm):
    from moe_runtime.common.host_values import all_gather_values, all_reduce_values, torch_device

    assert torch_device(cuda_comm) == torch.device("cuda", cuda_comm.cuda_device)
    gathered = all_gather_values(np.array([5, -2, 9], dtype=np.int64), cuda_comm)
    assert isinstance(gathered, np.ndarray) and gathered.tolist() == [5, -2, 9]
    reduced = all_reduce_values(np.array([0.25, 3.0]), cuda_comm, op="max")
    assert isinstance(reduced, np.ndarray) and reduced.tolist() == [0.25, 3.0]


def _step(comm, device, r: int, d: int) -> list:
    from moe_runtime import MoELayer

    layer = MoELayer({"type": "top", "k": 2}, 16,
                     {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32},
                     comm=comm, seeds=(3, 4)).to(device=device, dtype=torch.float64)
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(device)
    x.requires_grad_(True)
    y = layer(x, capacity_factor=1.0, adaptive_r=r, a2a_ffn_overlap_degree=d, algo="linear")
    (y.sum() + y.l_aux).backward()
    grads = [p.grad for p in layer.parameters()]
    return [t.detach().cpu() for t in (y, x.grad, y.l_aux, *grads)]


@pytest.mark.parametrize("r, d", [(0, 1), (1, 1), (1, 2)])
def test_a_layer_step_on_the_gpu_equals_the_host(cuda_comm, host_comm, r, d):
    got = _step(cuda_comm, torch.device("cuda", cuda_comm.cuda_device), r, d)
    want = _step(host_comm, torch.device("cpu"), r, d)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_the_bench_peer_agrees_with_the_layer_on_the_gpu(cuda_comm):
    from moe_runtime.bench.peer import check_peer

    result = check_peer(cuda_comm, experts=4, top_k=2, factors=(1.0, 0.5, 2.0))
    assert result.passed, result


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_ragged_ffn_runs_as_grouped_gemms_on_the_gpu(cuda_available, dtype):
    """The dropless flows' FFN as torch's grouped GEMMs (experts/grouped.py) against the loop over the
    experts, on the GPU; on sm_90 (the H200) bfloat16 must take the grouped GEMMs; float32 takes the loop
    (whose mm follows torch's TF32 setting)."""
    from moe_runtime.experts import grouped, ragged_ffn

    device, dt = torch.device("cuda"), getattr(torch, dtype)
    generator = torch.Generator().manual_seed(7)
    offsets = [0, 40, 40, 136, 200]  # an expert without rows
    rows = torch.randn(200, 64, generator=generator).to(device, dt)
    weights = [torch.randn(shape, generator=generator).mul(0.1).to(device, dt)
               for shape in ((4, 32, 64), (4, 32), (4, 32, 64), (4, 64))]
    groups = grouped.grouped_rows(rows, weights[0], weights[2], offsets)
    if dt == torch.float32:
        assert groups is None
        return
    if dt == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0):
        assert groups is not None, "torch's grouped GEMM does not run here in bfloat16"
    if groups is None:
        pytest.skip(f"torch's grouped GEMM does not run on this GPU in {dtype}")

    def step(use_grouped):
        leaves = [t.detach().clone().requires_grad_(True) for t in (rows, *weights)]
        original = ragged_ffn.grouped_rows
        ragged_ffn.grouped_rows = original if use_grouped else (lambda *args: None)
        try:
            y = ragged_ffn.ragged_ffn(leaves[0], offsets, *leaves[1:], torch.relu, weight_grad_scale=0.5)
            (y.float() * torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)).sum().backward()
        finally:
            ragged_ffn.grouped_rows = original
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]

    tolerance = 5e-2
    for got, want in zip(step(True), step(False)):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def _second_step_makes_no_sync(comm, factor, options, call):
    """A layer of the given construction options on `comm`'s GPU: one training step (buffers, the grouped
    GEMMs' probe, cuBLAS' workspace), then one under torch.cuda.set_sync_debug_mode("error"), which raises
    on any synchronizing torch call, naming it (a count read back, a copy from pageable memory)."""
    from moe_runtime import MoELayer

    device = torch.device("cuda", comm.cuda_device)
    layer = MoELayer({"type": "top", "k": 2, "capacity_factor": factor}, 64,
                     {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 64},
                     comm=comm, seeds=(3, 4), **options).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    x.requires_grad_(True)

    def step():
        y = layer(x, **call)
        (y.float().sum() + y.l_aux).backward()

    step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)


def test_a_dropless_step_on_the_gpu_makes_no_stream_sync_of_torch(cuda_comm):
    """The dropless flow's one wait per forward is a2a.permute's (in the core, for its counts), not
    torch's."""
    _second_step_makes_no_sync(cuda_comm, 0.0, {"flow": "dropless"}, {})


def test_a_dropless_step_without_a_wait_makes_no_stream_sync_of_torch(cuda_comm):
    """Dropless(wait=False): a2a.permute(..., wait=False) and the grouped GEMMs by offsets on the device."""
    from moe_runtime import Dropless

    _second_step_makes_no_sync(cuda_comm, 0.0, {"flow": Dropless(wait=False)}, {})


@pytest.mark.parametrize("options,call", [({}, {"adaptive_r": 0}), ({}, {"adaptive_r": 1}),
                                          ({}, {"adaptive_r": 1, "a2a_ffn_overlap_degree": 2}),
                                          ({"dropless_capacity": "worst_case", "factor": 0.0}, {})],
                         ids=["r=0", "r=1", "r=1 d=2", "f=0 worst case"])
def test_a_step_whose_shapes_are_known_makes_no_stream_sync_of_torch(cuda_comm, options, call):
    """The expert flow at f > 0 (and at f = 0 with the worst-case capacity) reads nothing back, on either
    communicator."""
    options = dict(options)
    _second_step_makes_no_sync(cuda_comm, options.pop("factor", 1.0), options, call)


@pytest.mark.parametrize("flow", ["data_centric", "model_centric"])
def test_the_hexa_flows_on_grouped_gemms_on_the_gpu(cuda_comm, flow):
    """Hexa-MoE's flows on rows grouped by expert (moe_runtime/hexa/rows.py; "auto" takes them in bfloat16
    where torch's grouped GEMM runs) against the expert-specific operators, both held against the float64
    layer on the GPU: the grouped path's error at most 1.5x the ES path's plus 1e-3 of the largest value."""
    import moe_runtime
    from moe_runtime.experts.grouped import grouped_gemms_run
    from moe_runtime.hexa.cache import PipelineSharedCache

    device = torch.device("cuda", cuda_comm.cuda_device)
    if not grouped_gemms_run(device, torch.bfloat16, 64, 128):
        pytest.skip("torch's grouped GEMM does not run on this GPU in bfloat16")
    settings = {"data_centric": moe_runtime.DataCentric, "model_centric": moe_runtime.ModelCentric}[flow]

    def step(kernels, dtype):
        options = {"kernels": kernels, **({"shared_cache": PipelineSharedCache()} if flow == "data_centric" else {})}
        layer = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 0.0}, 64,
                                     {"type": "ffn", "num_experts_per_device": 8, "hidden_size_per_expert": 128},
                                     comm=cuda_comm, seeds=(3, 4), flow=settings(**options)).to(device, dtype)
        x = torch.randn(256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(device, dtype)
        x.requires_grad_(True)
        y = layer(x)
        (y.double().mul(torch.linspace(-1, 1, y.numel(), device=device, dtype=torch.float64).view(y.shape)).sum()
         + y.l_aux).backward()
        return [t.detach().double().cpu() for t in (y, x.grad, *(p.grad for p in layer.parameters()))]

    exact = step("es", torch.float64)
    grouped, es = step("grouped", torch.bfloat16), step("es", torch.bfloat16)
    for i, (want, ours, theirs) in enumerate(zip(exact, grouped, es)):
        scale = max(want.abs().max().item(), 1e-30)
        error, es_error = (ours - want).abs().max().item() / scale, (theirs - want).abs().max().item() / scale
        assert error <= 1.5 * es_error + 1e-3, (i, error, es_error)


def test_a_compiled_model_holding_the_layer_on_the_gpu_is_one_graph_break(cuda_comm):
    """torch.compile of Linear, MoELayer, Linear on CUDA tensors: the layer runs eagerly
    behind one graph break, and the model's step equals the eager one (tests/unit/test_runtime_compile.py
    on the CPU)."""
    import torch._dynamo as dynamo

    from moe_runtime import MoELayer

    device = torch.device("cuda", cuda_comm.cuda_device)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), MoELayer(
            {"type": "top", "k": 2, "capacity_factor": 1.0}, 16,
            {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32}, comm=cuda_comm,
            seeds=(3, 4)), torch.nn.Linear(16, 16)).to(device)

    eager, compiled = model(), model()
    dynamo.reset()
    dynamo.utils.counters.clear()
    run = torch.compile(compiled, backend="aot_eager")  # no Triton build in the check's budget
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(5)).to(device)
    for _ in range(3):
        want, got = eager(x), run(x)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert dynamo.utils.counters["stats"]["unique_graphs"] <= 2, dict(dynamo.utils.counters["stats"])
    dynamo.reset()
