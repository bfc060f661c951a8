"""MoELayer(cuda_graphs=N) on one GPU (1 rank, NCCL; from_torch on a 1-rank
gloo group): training steps replayed from CUDA graphs equal the eager
layer's bitwise, step after step on new tokens, for every r and d that apply
on one rank, at f > 0 and at f = 0 with the worst-case capacity, through
MoELayer and Tutel's surface; a replay allocates nothing; what cannot be
captured is refused (common/graphs.py). A whole training step (forward, loss,
backward, the optimizer's step) that the caller captures in one
torch.cuda.graph, as Megatron-Core's full-iteration graphs do, replays the
eager steps bitwise too. Skipped without a GPU.""" 

from __future__ import annotations

import pytest

import a2a

torch = pytest.importorskip("torch")

M, H, T = 64, 96, 48


@pytest.fixture(scope="module")
def nccl_comm(cuda_available):
    from mpi4py import MPI

    if not a2a.config()["nccl"]:
        pytest.skip("a2a was built without NCCL (a2a.config()['nccl'] is False)")
    return a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda")


@pytest.fixture(scope="module")
def torch_comm(nccl_comm):
    """A NCCL communicator (from_torch) bootstrapped through a 1-rank gloo process group, beside it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return a2a.Comm.from_torch()


def _layer(comm, factor=1.0, **options):
    from moe_runtime import MoELayer

    layer = MoELayer({"type": "top", "k": 2, "capacity_factor": factor}, M,
                     {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": H},
                     comm=comm, seeds=(3, 4), **options)
    return layer.to(device=torch.device("cuda", comm.cuda_device), dtype=torch.bfloat16)


def _steps(layer, comm, call, steps=4):
    """Training steps on new tokens each (same shape): every output and gradient, copied out."""
    device = torch.device("cuda", comm.cuda_device)
    got = []
    for step in range(steps):
        x = torch.randn(T, M, generator=torch.Generator().manual_seed(10 + step)).to(device, torch.bfloat16)
        x.requires_grad_(True)
        for p in layer.parameters():
            p.grad = None
        y = layer(x, **call)
        (y.float().square().sum() + y.l_aux).backward()
        got.append([t.detach().clone() for t in (y, y.l_aux, x.grad, *(p.grad for p in layer.parameters()))])
    torch.cuda.synchronize()
    return got


CASES = [({}, {"adaptive_r": 0}), ({}, {"adaptive_r": 1}), ({}, {"adaptive_r": 1, "a2a_ffn_overlap_degree": 2}),
         ({"factor": 0.0, "dropless_capacity": "worst_case"}, {}),
         ({"batch_prioritized_routing": True}, {})]


@pytest.mark.parametrize("options,call", CASES, ids=["r=0", "r=1", "r=1 d=2", "f=0 worst case", "prioritized"])
def test_replayed_steps_equal_the_eager_ones_bitwise(nccl_comm, options, call):
    eager = _steps(_layer(nccl_comm, **options), nccl_comm, call)
    graphed_layer = _layer(nccl_comm, cuda_graphs=2, **options)
    graphed = _steps(graphed_layer, nccl_comm, call)
    assert len(graphed_layer.graphs) == 1  # one signature: captured once, replayed after
    for step, (g, e) in enumerate(zip(graphed, eager)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert torch.equal(a, b), f"step {step}, tensor {i}: the replay differs from the eager step"


def test_a_replay_allocates_nothing(nccl_comm):
    layer = _layer(nccl_comm, cuda_graphs=1)
    _steps(layer, nccl_comm, {}, steps=2)  # captured, then replayed once (the gradients exist)
    before = torch.cuda.memory_allocated()
    _steps(layer, nccl_comm, {}, steps=1)
    assert torch.cuda.memory_allocated() <= before + T * M * 2 * 2  # at most the step's tokens and their grad


def test_a_new_signature_is_captured_up_to_the_limit(nccl_comm):
    layer = _layer(nccl_comm, cuda_graphs=1)
    _steps(layer, nccl_comm, {}, steps=1)
    _steps(layer, nccl_comm, {"capacity_factor": 2.0}, steps=1)  # a second signature: eager, past the limit
    assert len(layer.graphs) == 1


def test_tutels_surface_replays_too(nccl_comm):
    from moe_runtime import moe as tutel_moe

    def make(**options):
        layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=M,
                                    experts={"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": H},
                                    group=nccl_comm, seeds=(1, 2), **options)
        return layer.to(device=torch.device("cuda", nccl_comm.cuda_device), dtype=torch.bfloat16)

    eager, graphed = _steps(make(), nccl_comm, {}), _steps(make(cuda_graphs=1), nccl_comm, {})
    for g, e in zip(graphed, eager):
        assert all(torch.equal(a, b) for a, b in zip(g, e))


def test_what_cannot_be_captured_is_refused(nccl_comm):
    from mpi4py import MPI

    with pytest.raises(ValueError, match="capacity_factor=0.0 sizes the capacity.*dropless_capacity='worst_case'"):
        _steps(_layer(nccl_comm, factor=0.0, cuda_graphs=1), nccl_comm, {}, steps=1)
    with pytest.raises(ValueError, match="flow 'dropless'"):
        _steps(_layer(nccl_comm, factor=0.0, cuda_graphs=1, flow="dropless"), nccl_comm, {}, steps=1)
    staged = a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda", transport="mpi")
    layer = _layer(staged, cuda_graphs=1)  # one rank exchanges with nobody: nothing waits, and it is captured
    _steps(layer, staged, {}, steps=2)
    assert len(layer.graphs) == 1


def test_gradients_accumulate_over_micro_batches_as_eagerly(nccl_comm):
    """Two micro-batches into the same .grad, then a third step after zeroing: a replay's gradients are
    copies (torch's AccumulateGrad would otherwise keep the graph's buffer as .grad, and the next replay
    would overwrite and double it)."""
    device = torch.device("cuda", nccl_comm.cuda_device)

    def accumulated(layer):
        for p in layer.parameters():
            p.grad = None
        for step in range(3):
            if step == 2:
                layer.zero_grad(set_to_none=False)
            x = torch.randn(T, M, generator=torch.Generator().manual_seed(20 + step)).to(device, torch.bfloat16)
            y = layer(x.requires_grad_(True))
            (y.float().square().sum() + y.l_aux).backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in layer.parameters()]

    eager, graphed = accumulated(_layer(nccl_comm)), accumulated(_layer(nccl_comm, cuda_graphs=1))
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager))


def test_a_second_forward_before_the_backward_runs_eagerly(nccl_comm):
    """Pipelining two micro-batches (1F1B): the second call comes before the first's backward, so it
    runs eagerly instead of overwriting what the first replay's backward reads."""
    device = torch.device("cuda", nccl_comm.cuda_device)

    def interleaved(layer):
        xs = [torch.randn(T, M, generator=torch.Generator().manual_seed(30 + i)).to(device, torch.bfloat16)
              .requires_grad_(True) for i in range(2)]
        ys = [layer(x) for x in xs]
        for y in reversed(ys):
            (y.float().square().sum() + y.l_aux).backward()
        torch.cuda.synchronize()
        return [t.clone() for t in (*ys, *(x.grad for x in xs), *(p.grad for p in layer.parameters()))]

    eager, graphed = interleaved(_layer(nccl_comm)), interleaved(_layer(nccl_comm, cuda_graphs=1))
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager))


def test_a_from_torch_communicator_of_one_rank_replays_too(torch_comm):
    eager = _steps(_layer(torch_comm), torch_comm, {})
    graphed_layer = _layer(torch_comm, cuda_graphs=1)
    graphed = _steps(graphed_layer, torch_comm, {})
    assert len(graphed_layer.graphs) == 1
    for g, e in zip(graphed, eager):
        assert all(torch.equal(a, b) for a, b in zip(g, e))


def _trained(layer, comm, call, captured, steps=4):
    """SGD steps on new tokens each (same shape), eagerly or as the caller's capture of the whole
    step replayed: every output, gradient and updated weight, copied out."""
    device = torch.device("cuda", comm.cuda_device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.zeros(T, M, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = layer(x, **call)
        (y.float().square().sum() + y.l_aux).backward()
        optimizer.step()
        return y

    graph = None
    if captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy state (buffers, plans, cuBLAS' workspace) before the capture
            for _ in range(3):
                y = layer(x, **call)
                (y.float().square().sum() + y.l_aux).backward()
                x.grad = None
                optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()
    got = []
    for n in range(steps):
        tokens = torch.randn(T, M, generator=torch.Generator().manual_seed(10 + n)).to(device, torch.bfloat16)
        x.detach().copy_(tokens)
        if graph is None:
            x.grad = None
            optimizer.zero_grad(set_to_none=True)
            y = step()
        else:
            graph.replay()
            y = static_y
        got.append([t.detach().clone() for t in (y, y.l_aux, x.grad, *(p.grad for p in layer.parameters()),
                                                  *layer.parameters())])
    torch.cuda.synchronize()
    if graph is not None:
        graph.reset()  # before the communicator can go (NCCL's finalize waits for a live graph's work)
        layer.drop_captured_buffers()
    return got


def test_a_dropless_step_without_a_wait_replays_bitwise_in_either_capture(nccl_comm):
    """Dropless(wait=False) (one rank): the layer's own graphs and the caller's capture of the whole step."""
    from moe_runtime import Dropless

    options = {"factor": 0.0, "flow": Dropless(wait=False)}
    eager = _steps(_layer(nccl_comm, **options), nccl_comm, {})
    graphed_layer = _layer(nccl_comm, cuda_graphs=1, **options)
    for g, e in zip(_steps(graphed_layer, nccl_comm, {}), eager):
        assert all(torch.equal(a, b) for a, b in zip(g, e))
    assert len(graphed_layer.graphs) == 1
    trained = _trained(_layer(nccl_comm, **options), nccl_comm, {}, captured=False)
    replayed = _trained(_layer(nccl_comm, **options), nccl_comm, {}, captured=True)
    for g, e in zip(replayed, trained):
        assert all(torch.equal(a, b) for a, b in zip(g, e))


@pytest.mark.parametrize("options,call", CASES[:4], ids=["r=0", "r=1", "r=1 d=2", "f=0 worst case"])
def test_a_whole_step_captured_by_the_caller_replays_the_eager_steps_bitwise(nccl_comm, options, call):
    eager = _trained(_layer(nccl_comm, **options), nccl_comm, call, captured=False)
    layer = _layer(nccl_comm, **options)
    replayed = _trained(layer, nccl_comm, call, captured=True)
    for step, (g, e) in enumerate(zip(replayed, eager)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert torch.equal(a, b), f"step {step}, tensor {i}: the replay differs from the eager step"
    assert layer._pool.captured == []


def test_what_cannot_run_in_the_callers_capture_is_refused_before_it_breaks_the_capture(nccl_comm):
    layer = _layer(nccl_comm, 0.0)  # f = 0 reads the counts back
    x = torch.randn(T, M, device=torch.device("cuda", nccl_comm.cuda_device), dtype=torch.bfloat16)
    layer(x)  # lazy state, outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="MoELayer cannot run inside the CUDA graph being captured: "
                                         "capacity_factor=0.0"), torch.cuda.graph(graph):
        layer(x)

