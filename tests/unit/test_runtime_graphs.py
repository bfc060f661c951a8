"""MoELayer(cuda_graphs=N) where no GPU is: its argument, its refusals
(common/graphs.check_capturable, on a stand-in for a CUDA communicator),
and the buffers a capture keeps to itself (BufferPool.isolated). The
captures and replays themselves: tests/gpu/test_layer_graphs_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

import moe_runtime
from moe_runtime.common.buffers import BufferPool
from moe_runtime.common.graphs import check_capturable

M = 16


def layer_of(comm, factor=1.0, **options):
    return moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": factor}, M,
                                {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8},
                                comm=comm, seeds=(1, 2), **options)


@dataclasses.dataclass
class CudaLike:
    """What check_capturable reads of a communicator."""

    device: str = "cuda"
    transport: str = "nccl"
    size: int = 1
    mpi_comm: object = None
    control_group: object = None


CALL = {"gate_index": 0, "capacity_factor": None, "top_k": None, "a2a_ffn_overlap_degree": None,
        "adaptive_r": None, "algo": None, "flow": None, "sample_ids": None}


def refusal(layer, comm=None, **call):
    layer.comm = comm or CudaLike()
    try:
        check_capturable(layer, {**CALL, **call})
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_the_limit_is_a_non_negative_integer(comm, value):
    with pytest.raises(ValueError, match=f"cuda_graphs must be a non-negative integer.*got {value!r}"):
        layer_of(comm, cuda_graphs=value)


def test_a_training_call_on_a_host_communicator_is_refused_and_inference_runs(comm):
    layer = layer_of(comm, cuda_graphs=2)
    x = torch.randn(8, M)
    with torch.no_grad():
        eager = layer_of(comm)(x)
        assert torch.equal(layer(x), eager)  # not recorded: eager, as without graphs
    with pytest.raises(ValueError, match="cannot capture this call: the layer's communicator is a cpu one"):
        layer(x)
    assert len(layer.graphs) == 0


def test_what_can_be_captured(comm):
    assert refusal(layer_of(comm)) is None
    assert refusal(layer_of(comm), a2a_ffn_overlap_degree=2, adaptive_r=0) is None
    assert refusal(layer_of(comm, 0.0, dropless_capacity="worst_case")) is None
    assert refusal(layer_of(comm), CudaLike(transport="mpi")) is None  # one rank exchanges with nobody
    assert refusal(layer_of(comm, 0.0, flow=moe_runtime.Dropless(wait=False))) is None  # reads nothing back


@pytest.mark.parametrize("case,call,match", [
    ({"factor": 0.0}, {}, "capacity_factor=0.0 sizes the capacity.*dropless_capacity='worst_case'"),
    ({"factor": -1.0, "dropless_capacity": "worst_case"}, {}, "capacity_factor=-1.0 sizes the capacity"),
    ({}, {"capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"factor": 0.0, "flow": "dropless"}, {}, "flow 'dropless' times its steps, reads counts back"),
    ({"factor": 0.0, "parallel_type": "adaptive:auto", "flows": ("dropless",)}, {}, "with the dictionary"),
    ({}, {"flow": "dropless"}, "flow= and sample_ids="),
], ids=["f=0", "f<0", "call f=0", "dropless flow", "dictionary", "call flow"])
def test_what_is_refused(comm, case, call, match):
    case = dict(case)
    layer = layer_of(comm, case.pop("factor", 1.0), **case)
    assert refusal(layer, **call) is not None
    with pytest.raises(ValueError, match=match):
        layer.comm = CudaLike()
        check_capturable(layer, {**CALL, **call})


def test_the_staged_transport_is_refused_across_ranks(comm):
    why = refusal(layer_of(comm), CudaLike(transport="mpi", size=2))
    assert "staged MPI transport waits for the stream" in why


def test_nccl_alone_is_refused_across_ranks_in_either_capture(comm):
    """Its call's check (the agreement, a replay's table) would wait for the stream: refused by
    check_capturable, which both the layer's own graphs and the caller's capture go through."""
    assert "has NCCL as its only channel" in refusal(layer_of(comm), CudaLike(size=2))
    assert refusal(layer_of(comm), CudaLike(size=2, mpi_comm=object())) is None  # MPI beside NCCL
    assert refusal(layer_of(comm), CudaLike(size=2, control_group=object())) is None  # gloo beside NCCL


def test_a_capture_keeps_its_buffers_to_itself():
    pool = BufferPool()
    eager = pool.lease()
    eager.get("a", (4,), torch.float32, torch.device("cpu"))
    del eager  # the pool's one free set
    with pool.isolated() as captured:
        lease = pool.lease()  # not the pool's set: a new one
        buffer = lease.get("a", (4,), torch.float32, torch.device("cpu"))
    del lease  # back to the capture's list, after the isolation ended
    assert len(captured) == 1 and captured[0]["a"].data_ptr() == buffer.data_ptr()
    assert [address for _, address, _ in pool.snapshot()] != [buffer.data_ptr()] and len(pool.snapshot()) == 1
    assert pool.lease()._buffers is not captured[0]


@pytest.fixture
def capture_on_the_host(monkeypatch):
    """Captures that run the step eagerly, on any communicator: the bookkeeping around
    make_graphed_callables (signatures, the limit, the buffers) without a GPU. Returns the captures made."""
    from moe_runtime.common import graphs

    class Made(list):
        replays: list[int]

    made = Made()

    def capture(step, sample_args, **options):
        made.append((step, tuple(t.shape for t in sample_args), options))
        y, l_aux = step(*sample_args)  # as make_graphed_callables' warm-up and capture run it, inside the isolation
        (y.sum() + l_aux).backward()

        def replay(x):  # its "replays" run the step eagerly, outside
            replays[0] += 1
            return step(x)

        return replay

    replays = [0]
    made.replays = replays

    monkeypatch.setattr(graphs, "check_capturable", lambda layer, arguments: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    return made


def test_one_capture_per_signature_up_to_the_limit(comm, capture_on_the_host):
    layer, eager = layer_of(comm, cuda_graphs=2), layer_of(comm)
    for tokens, call in ((8, {}), (8, {}), (5, {}), (8, {"capacity_factor": 2.0}), (5, {})):
        x = torch.randn(tokens, M, generator=torch.Generator().manual_seed(tokens))
        y = layer(x.requires_grad_(), **call)
        want = eager(x, **call)
        assert torch.equal(y, want) and torch.equal(y.l_aux, want.l_aux) and layer.l_aux is y.l_aux
    # (8,) and (5,) captured; f = 2 is a third signature, past the limit: eager.
    assert [shapes for _, shapes, _ in capture_on_the_host] == [((8, M),), ((5, M),)]
    assert capture_on_the_host[0][2] == {"num_warmup_iters": 3, "allow_unused_input": True}
    assert len(layer.graphs) == 2
    layer.place(layer.placement)  # the positions may change: the captures go
    assert len(layer.graphs) == 0


def test_a_capture_takes_buffers_no_eager_call_shares(comm, capture_on_the_host):
    layer = layer_of(comm, cuda_graphs=1)
    x = torch.randn(8, M, requires_grad=True)
    layer(x).sum().backward()  # the capture's run inside the isolation, then a "replay" (eager) outside
    captured = next(iter(layer.graphs._captured.values()))
    kept = {t.data_ptr() for buffers in captured.buffers for t in buffers.values()}
    assert kept and not kept & {address for _, address, _ in layer._pool.snapshot()}


def test_moving_the_layer_drops_its_captures(comm, capture_on_the_host):
    layer = layer_of(comm, cuda_graphs=1)
    layer(torch.randn(8, M, requires_grad=True))
    assert len(layer.graphs) == 1
    layer.double()  # new parameter tensors: a replay would read the old ones
    assert len(layer.graphs) == 0


def test_no_replay_before_the_last_replays_backward(comm, capture_on_the_host):
    """A replay overwrites the memory the previous replay's backward reads: until that backward runs (or
    its output is gone), calls run eagerly."""
    layer, eager = layer_of(comm, cuda_graphs=1), layer_of(comm)
    x = torch.randn(8, M, requires_grad=True)
    first = layer(x)
    assert capture_on_the_host.replays == [1]
    second = layer(x)  # the first replay's backward is pending: eager
    assert capture_on_the_host.replays == [1] and torch.equal(second, eager(x))
    (first.sum() + first.l_aux).backward()
    third = layer(x)
    assert capture_on_the_host.replays == [2]
    del third  # gone without a backward: nothing is pending
    layer(x)
    assert capture_on_the_host.replays == [3] and len(layer.graphs) == 1 and second is not None


def test_an_earlier_output_freed_late_does_not_end_a_later_replays_wait(comm, capture_on_the_host):
    """``y = layer(x)`` frees the last y after the new replay: that must not clear the new one's wait."""
    layer = layer_of(comm, cuda_graphs=1)
    x = torch.randn(8, M, requires_grad=True)
    y = layer(x)
    (y.sum() + y.l_aux).backward()
    y = layer(x)  # the second replay; the first output goes only now
    assert capture_on_the_host.replays == [2]
    layer(x)  # the second replay's backward is pending: eager
    assert capture_on_the_host.replays == [2]
    (y.sum() + y.l_aux).backward()
    layer(x)
    assert capture_on_the_host.replays == [3]


def test_new_parameter_tensors_drop_the_captures(comm, capture_on_the_host):
    layer = layer_of(comm, cuda_graphs=2)
    x = torch.randn(8, M, requires_grad=True)
    layer(x)
    weight = layer.gates[0].wg.weight
    layer.gates[0].wg.weight = torch.nn.Parameter(weight.detach().clone())  # not through .to(): a new tensor
    layer(x)
    assert len(capture_on_the_host) == 2 and len(layer.graphs) == 1  # captured anew, the old capture dropped


def test_a_routing_trace_is_refused(comm):
    layer = layer_of(comm)
    layer.routing_trace = []
    assert "routing_trace reads each call's counts back" in refusal(layer)


def test_a_call_in_the_callers_capture_keeps_its_buffers_until_dropped(comm, monkeypatch):
    from moe_runtime.common import graphs

    layer, eager = layer_of(comm), layer_of(comm)
    x = torch.randn(8, M, requires_grad=True)
    y = layer(x)  # eager: the pool's set
    (y.sum() + y.l_aux).backward()
    del y
    pooled = {address for _, address, _ in layer._pool.snapshot()}
    checked = []
    with monkeypatch.context() as patch:
        patch.setattr(graphs, "captured_by_caller", lambda comm, x: True)
        patch.setattr(graphs, "check_capturable", lambda layer, arguments, refused: checked.append(refused))
        y = layer(x)  # "captured": a set of its own, which the pool keeps for the graph
        (y.sum() + y.l_aux).backward()
    assert checked == ["MoELayer cannot run inside the CUDA graph being captured"]
    assert torch.equal(y, eager(x))
    del y  # its step's graph, and so its lease, goes: back to the capture's list
    [captured] = layer._pool.captured
    kept = {t.data_ptr() for buffers in captured for t in buffers.values()}
    assert kept and not kept & pooled and {address for _, address, _ in layer._pool.snapshot()} == pooled
    y = layer(x)  # eager again: never the capture's buffers
    (y.sum() + y.l_aux).backward()
    del y
    assert {address for _, address, _ in layer._pool.snapshot()} == pooled
    layer.drop_captured_buffers()
    assert layer._pool.captured == []


def test_a_call_in_the_callers_capture_is_refused_as_the_layers_own(comm, monkeypatch):
    from moe_runtime.common import graphs

    monkeypatch.setattr(graphs, "captured_by_caller", lambda comm, x: True)
    layer = layer_of(comm, 0.0)  # f = 0 reads the counts back
    with pytest.raises(ValueError, match="MoELayer cannot run inside the CUDA graph being captured: the layer's "
                                         "communicator is a cpu one"):
        layer(torch.randn(8, M))
    layer.comm = CudaLike()
    with pytest.raises(ValueError, match="inside the CUDA graph being captured: capacity_factor=0.0 sizes"):
        check_capturable(layer, CALL, "MoELayer cannot run inside the CUDA graph being captured")


def test_the_layers_own_capture_inside_a_callers_keeps_one_set():
    """for_capture inside isolated (cuda_graphs= under an outer capture) leaves the sets to the inner one."""
    pool = BufferPool()
    with pool.isolated() as own, pool.for_capture():
        lease = pool.lease()
        lease.get("a", (4,), torch.float32, torch.device("cpu"))
        del lease
    assert len(own) == 1 and pool.captured == []


def test_the_layers_own_graphs_step_aside_in_the_callers_capture(comm, monkeypatch, capture_on_the_host):
    from moe_runtime.common import graphs

    monkeypatch.setattr(graphs, "captured_by_caller", lambda comm, x: True)
    monkeypatch.setattr(graphs, "check_capturable", lambda layer, arguments, refused: None)
    layer = layer_of(comm, cuda_graphs=1)
    y = layer(torch.randn(8, M, requires_grad=True))
    (y.sum() + y.l_aux).backward()
    del y
    assert len(capture_on_the_host) == 0 and len(layer.graphs) == 0 and len(layer._pool.captured) == 1


def test_the_layers_check_completes_what_its_communicators_posted(comm, monkeypatch):
    """layer.check() (after the caller's capture at W > 1): check() on each communicator of the layer that
    predicts its checks, once each; the others (a 1-rank or host one) are left alone."""
    layer = layer_of(comm)
    layer.check()  # nothing posted: a no-op
    completed = []

    @dataclasses.dataclass(eq=False)
    class Predicting:
        name: str
        predicts_check: bool = True

        def check(self):
            completed.append(self.name)

    shared = Predicting("shared")
    monkeypatch.setattr(layer.flow, "context", dataclasses.replace(layer.flow.context, comm=shared,
                                                                   exchange_comm=Predicting("exchanges")))
    layer.check()
    monkeypatch.setattr(layer.flow, "context", dataclasses.replace(layer.flow.context, exchange_comm=shared))
    layer.check()
    assert completed == ["shared", "exchanges", "shared"]
