"""The collectives on CUDA buffers, bitwise against the host communicator on
the same data: every algorithm on a 1-rank NCCL communicator (made over MPI
and through torch.distributed), torch CUDA tensors and CuPy arrays, the
caller's stream, CUDA-graph capture, and the errors of mixing memories.
Skipped without a GPU, a CUDA build, or (for NCCL) a NCCL build of a2a."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from checks import raises_invalid

import a2a

torch = pytest.importorskip("torch")

DTYPES = ("float32", "bfloat16", "int8", "float64")
FLEX_CASES = {
    "moe-dispatch": ((2, 3, 5), 0, 1),
    "moe-combine": ((2, 3, 5), 1, 0),
    "odd-middle": ((3, 7, 5), 1, 2),
    "last-to-first": ((2, 1, 3, 1), 3, 0),
    "1d": ((5,), 0, 0),
    "zero-leading": ((0, 2), 1, 0),
}


def _need_nccl() -> None:
    if not a2a.config()["nccl"]:
        pytest.skip("a2a was built without NCCL (a2a.config()['nccl'] is False)")


@pytest.fixture(scope="module")
def host_comm():
    from mpi4py import MPI

    return a2a.Comm.from_mpi(MPI.COMM_SELF)


@pytest.fixture(scope="module")
def nccl_comm(cuda_available):
    _need_nccl()
    from mpi4py import MPI

    return a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda")


@pytest.fixture(scope="module")
def staged_comm(cuda_available):
    from mpi4py import MPI

    return a2a.Comm.from_mpi(MPI.COMM_SELF, device="cuda", transport="mpi")


@pytest.fixture(scope="module")
def torch_comm(cuda_available):
    """A NCCL communicator bootstrapped through a 1-rank gloo process group,
    which stands beside it for the check and the host values."""
    _need_nccl()
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return a2a.Comm.from_torch()


@pytest.fixture(scope="module")
def nccl_only_comm(torch_comm):
    """NCCL alone: from_torch over a NCCL subgroup, with no gloo beside it."""
    import torch.distributed as dist

    return a2a.Comm.from_torch(dist.new_group(backend="nccl"))


def test_from_torch_puts_a_gloo_group_beside_nccl(torch_comm, nccl_only_comm):
    import torch.distributed as dist

    assert torch_comm.control_group is dist.group.WORLD and nccl_only_comm.control_group is None
    assert torch_comm.host_twin().device == "cpu" and nccl_only_comm.host_twin() is nccl_only_comm


def _cuda(a: np.ndarray, dtype: str):
    return ref.to_framework(a, dtype, "torch").cuda()


def _host(t) -> np.ndarray:
    return ref.raw_bytes(t.cpu())


def test_comm_reports_device_and_transport(nccl_comm, staged_comm, host_comm):
    assert (nccl_comm.device, nccl_comm.transport, nccl_comm.cuda_device) == ("cuda", "nccl", torch.cuda.current_device())
    assert (staged_comm.device, staged_comm.transport) == ("cuda", "mpi")
    assert (host_comm.device, host_comm.transport, host_comm.cuda_device) == ("cpu", "mpi", None)
    assert "cuda:" in repr(nccl_comm)


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_matches_the_host(request, comm_name, algo, dtype, host_comm):
    comm = request.getfixturevalue(comm_name)
    x = ref.a2a_input("gpu-a2a", 0, 1, (1000, 3), dtype)
    want = a2a.all_to_all(ref.to_framework(x, dtype, "torch"), comm=host_comm, algo=algo)
    got = a2a.all_to_all(_cuda(x, dtype), comm=comm, algo=algo)
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape
    ref.assert_bitwise_equal(got.cpu(), want, f"{comm_name} {algo} {dtype}")


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bool", "complex64"])
def test_dtypes_moved_as_bytes_match_the_host(request, comm_name, dtype, host_comm):
    """a2a/_bytes.py on CUDA tensors: FP8 rows of a caller's own quantization, masks, complex."""
    comm = request.getfixturevalue(comm_name)
    x = (torch.randn(999, 3) * 4).to(getattr(torch, dtype)) if dtype != "bool" else torch.randn(999, 3) > 0
    want = a2a.all_to_all_flex(x, comm=host_comm, split_axis=0, concat_axis=-1)
    got = a2a.all_to_all_flex(x.cuda(), comm=comm, split_axis=0, concat_axis=-1)
    assert got.is_cuda and got.dtype == x.dtype and got.shape == want.shape
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("case", sorted(FLEX_CASES))
def test_all_to_all_flex_matches_the_host(request, comm_name, algo, case, host_comm):
    comm = request.getfixturevalue(comm_name)
    shape, split, concat = FLEX_CASES[case]
    x = ref.flex_input("gpu-flex", 0, 1, shape, split, "float32")
    want = a2a.all_to_all_flex(x, comm=host_comm, split_axis=split, concat_axis=concat, algo=algo)
    got = a2a.all_to_all_flex(_cuda(x, "float32"), comm=comm, split_axis=split, concat_axis=concat, algo=algo)
    ref.assert_bitwise_equal(got.cpu(), want, f"{comm_name} {algo} {case}")


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
@pytest.mark.parametrize("algo", ["linear", "2dh"])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_all_to_all_v_matches_the_host(request, comm_name, algo, rows, host_comm):
    comm = request.getfixturevalue(comm_name)
    counts = np.array([rows])
    x = ref.v_input("gpu-v", 0, counts.reshape(1, 1), (5,), "float16")
    want, want_counts = a2a.all_to_all_v(ref.to_framework(x, "float16", "torch"), counts, comm=host_comm, algo=algo)
    got, got_counts = a2a.all_to_all_v(_cuda(x, "float16"), torch.tensor(counts).cuda(), comm=comm, algo=algo)
    np.testing.assert_array_equal(got_counts, want_counts)
    ref.assert_bitwise_equal(got.cpu(), want, f"{comm_name} {algo} rows={rows}")


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float16"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_dense_collectives_match_the_host(request, comm_name, dtype, op, host_comm):
    comm = request.getfixturevalue(comm_name)
    x = ref.a2a_input("gpu-dense", 0, 1, (6, 5), dtype)
    host_x = ref.to_framework(x, dtype, "torch")
    cases = [
        ("all_gather", a2a.all_gather(host_x, comm=host_comm), a2a.all_gather(_cuda(x, dtype), comm=comm)),
        ("all_reduce", a2a.all_reduce(host_x, comm=host_comm, op=op), a2a.all_reduce(_cuda(x, dtype), comm=comm, op=op)),
        (
            "reduce_scatter",
            a2a.reduce_scatter(host_x, comm=host_comm, op=op),
            a2a.reduce_scatter(_cuda(x, dtype), comm=comm, op=op),
        ),
    ]
    in_place = _cuda(x, dtype)
    assert a2a.all_reduce(in_place, comm=comm, op=op, out=in_place) is in_place
    cases.append(("all_reduce in place", cases[1][1], in_place))
    for name, want, got in cases:
        assert got.is_cuda
        ref.assert_bitwise_equal(got.cpu(), want, f"{comm_name} {name} {dtype} {op}")


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [0, 1, 6])
def test_dense_v_matches_the_host(request, comm_name, dtype, rows, host_comm):
    """all_gather_v (a grouped ncclBroadcast on NCCL) and reduce_scatter_v (a
    grouped ncclReduce), counts on the host or on the GPU."""
    comm = request.getfixturevalue(comm_name)
    x = ref.a2a_input("gpu-dense-v", 0, 1, (rows, 5), dtype)
    host_x = ref.to_framework(x, dtype, "torch")
    cases = [
        (
            "all_gather_v",
            a2a.all_gather_v(host_x, [rows], comm=host_comm),
            a2a.all_gather_v(_cuda(x, dtype), [rows], comm=comm),
        ),
        (
            "reduce_scatter_v",
            a2a.reduce_scatter_v(host_x, [rows], comm=host_comm, op="max"),
            a2a.reduce_scatter_v(_cuda(x, dtype), torch.tensor([rows]).cuda(), comm=comm, op="max"),
        ),
    ]
    for name, want, got in cases:
        assert got.is_cuda and tuple(got.shape) == (rows, 5), name
        if rows:  # raw bytes of an empty bfloat16 tensor cannot be viewed
            ref.assert_bitwise_equal(got.cpu(), want, f"{comm_name} {name} {dtype}")


def test_out_and_a_non_default_stream(nccl_comm, host_comm):
    x = ref.a2a_input("gpu-stream", 0, 1, (1 << 16,), "float32")
    want = a2a.all_to_all(x, comm=host_comm)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = _cuda(x, "float32")
        out = torch.empty_like(src)
        result = a2a.all_to_all(src, comm=nccl_comm, out=out)
        assert result is out
    stream.synchronize()
    ref.assert_bitwise_equal(out.cpu(), want, "on a side stream")


def test_switching_streams_keeps_the_shared_workspace_ordered(nccl_comm, host_comm):
    # all_to_all_flex with split_axis=1 packs through the communicator's
    # workspace; back-to-back calls on two streams reuse it.
    shape = (64, 8, 1024)
    inputs = [ref.flex_input(f"gpu-streams{i}", 0, 1, shape, 1, "float32") for i in range(2)]
    wants = [a2a.all_to_all_flex(x, comm=host_comm, split_axis=1, concat_axis=0) for x in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    srcs = [_cuda(x, "float32") for x in inputs]
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        for stream, src in zip(streams, srcs):
            with torch.cuda.stream(stream):
                outs.append(a2a.all_to_all_flex(src, comm=nccl_comm, split_axis=1, concat_axis=0))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        ref.assert_bitwise_equal(out.cpu(), wants[i % 2], f"call {i}")


def test_cuda_graph_capture_of_the_fixed_size_collectives(nccl_comm, host_comm):
    # NCCL communicators made over MPI check arguments over MPI (host), so
    # all_to_all and all_to_all_flex can be captured and replayed.
    x = ref.flex_input("gpu-graph", 0, 1, (4, 6, 8), 1, "float32")
    want = a2a.all_to_all_flex(x, comm=host_comm, split_axis=1, concat_axis=0)
    src = _cuda(x, "float32")
    out = torch.empty((4, 6, 8), device="cuda")
    a2a.all_to_all_flex(src, comm=nccl_comm, split_axis=1, concat_axis=0, out=out)  # warm-up: workspace, connections
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a2a.all_to_all_flex(src, comm=nccl_comm, split_axis=1, concat_axis=0, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref.assert_bitwise_equal(out.cpu(), want, "graph replay")


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture leaves its graph empty
def test_capture_on_a_nccl_only_communicator(nccl_only_comm, host_comm):
    # Made through torch.distributed with no gloo beside it, the communicator
    # checks arguments over NCCL by waiting for the stream: under capture only
    # the local checks run and the fixed-size collectives are captured; an
    # all_to_all_v plan needs the counts on the host and is refused, leaving
    # the communicator usable.
    torch_comm = nccl_only_comm
    x = ref.a2a_input("gpu-graph-torch", 0, 1, (64, 3), "float32")
    want = a2a.all_to_all(x, comm=host_comm)
    src = _cuda(x, "float32")
    out = torch.empty_like(src)
    a2a.all_to_all(src, comm=torch_comm, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a2a.all_to_all(src, comm=torch_comm, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref.assert_bitwise_equal(out.cpu(), want, "graph replay on a from_torch communicator")
    refused = torch.cuda.CUDAGraph()
    with pytest.raises(a2a.UnsupportedError, match="captured into a CUDA graph"), torch.cuda.graph(refused):
        a2a.all_to_all_v(src, [64], comm=torch_comm)
    got, counts = a2a.all_to_all_v(src, [64], comm=torch_comm)
    assert list(counts) == [64]
    ref.assert_bitwise_equal(got.cpu(), want, "all_to_all_v after the refused capture")


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture leaves its graph empty
def test_staged_transport_refuses_graph_capture(staged_comm):
    src = torch.arange(8.0, device="cuda")
    out = torch.empty_like(src)
    a2a.all_to_all(src, comm=staged_comm, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(a2a.UnsupportedError, match="captured into a CUDA graph"), torch.cuda.graph(graph):
        a2a.all_to_all(src, comm=staged_comm, out=out)
    # Refused before anything was enqueued: the communicator is still usable.
    out.zero_()
    a2a.all_to_all(src, comm=staged_comm, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, src)


def test_cupy_arrays(nccl_comm, host_comm):
    cupy = pytest.importorskip("cupy")
    x = ref.a2a_input("gpu-cupy", 0, 1, (64, 5), "float32")
    want = a2a.all_to_all(x, comm=host_comm, algo="2dh")
    got = a2a.all_to_all(cupy.asarray(x), comm=nccl_comm, algo="2dh")
    assert isinstance(got, cupy.ndarray)
    ref.assert_bitwise_equal(cupy.asnumpy(got), want, "cupy")
    got = a2a.all_to_all_flex(cupy.asarray(x), comm=nccl_comm, split_axis=0, concat_axis=1)
    ref.assert_bitwise_equal(
        cupy.asnumpy(got), a2a.all_to_all_flex(x, comm=host_comm, split_axis=0, concat_axis=1), "cupy flex"
    )


def test_host_memory_on_a_cuda_comm_is_rejected(nccl_comm):
    raises_invalid(lambda: a2a.all_to_all(np.zeros(4, np.float32), comm=nccl_comm), "numpy", "on cpu", "cuda:")
    raises_invalid(lambda: a2a.all_to_all(torch.zeros(4), comm=nccl_comm), "cpu", "cuda:")


def test_cuda_memory_on_a_host_comm_is_rejected(host_comm):
    raises_invalid(lambda: a2a.all_to_all(torch.zeros(4, device="cuda"), comm=host_comm), "cuda:", "host memory")


def test_out_on_another_device_is_rejected(nccl_comm):
    raises_invalid(
        lambda: a2a.all_to_all(torch.zeros(4, device="cuda"), comm=nccl_comm, out=torch.zeros(4)), "out", "cpu"
    )


def test_transport_nccl_needs_cuda():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="device='cuda'"):
        a2a.Comm.from_mpi(MPI.COMM_SELF, transport="nccl")


@pytest.mark.parametrize("comm_name", ["nccl_comm", "staged_comm", "torch_comm"])
def test_split_makes_a_cuda_comm_of_the_same_kind(request, comm_name, host_comm):
    """A split of a CUDA communicator (ncclCommSplit for NCCL, with MPI or
    NCCL itself as the control transport; the staged MPI transport) is one of
    the same kind, and so is its own split."""
    comm = request.getfixturevalue(comm_name)
    assert comm.split(None) is None
    child = comm.split(0)
    grandchild = child.split(3, key=-1)
    for c in (child, grandchild):
        assert (c.device, c.transport, c.cuda_device) == (comm.device, comm.transport, comm.cuda_device)
        assert (c.rank, c.size, c.local_size) == (0, 1, 1)
        for algo in ("linear", "2dh"):
            x = ref.a2a_input("gpu-split", 0, 1, (100, 3), "bfloat16")
            want = a2a.all_to_all(ref.to_framework(x, "bfloat16", "torch"), comm=host_comm, algo=algo)
            ref.assert_bitwise_equal(a2a.all_to_all(_cuda(x, "bfloat16"), comm=c, algo=algo).cpu(), want, algo)
            got, counts = a2a.all_to_all_v(_cuda(x, "bfloat16"), [100], comm=c, algo=algo)
            assert list(counts) == [100]
            ref.assert_bitwise_equal(got.cpu(), want, f"all_to_all_v {algo}")
        d = ref.a2a_input("gpu-split-dense", 0, 1, (6, 5), "float32")
        ref.assert_bitwise_equal(a2a.all_reduce(_cuda(d, "float32"), comm=c, op="max").cpu(), d, "all_reduce")
        ref.assert_bitwise_equal(a2a.all_gather(_cuda(d, "float32"), comm=c).cpu(), d, "all_gather")
    del child
    torch.cuda.synchronize()
    ref.assert_bitwise_equal(a2a.all_reduce(_cuda(d, "float32"), comm=grandchild).cpu(), d, "after its parent")

