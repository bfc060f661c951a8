"""a2a.LowLatencyBuffer under mpirun: dispatch and combine against a plain
reference built from every rank's inputs (each rank can make any rank's:
they depend on (tag, rank) only). The rows an expert receives are the
sources' rows bit for bit, in (source rank, token) order; y is the gated sum
of the experts' outputs in choice order (float32 accumulation) within
rounding of a float64 sum; FP8 rows are the sources' FP8 rows, dequantized.
Errors: a rank with bad input fails with InvalidArgumentError, every other
rank with RemoteError naming it, calls out of step with MismatchError, and
the buffer works again afterwards."""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

import a2a

M = 40


def inputs(tag: str, rank: int, tokens: int, top_k: int, num_experts: int, dtype: torch.dtype):
    """(x, indices, gates) of one rank: unrouted choices and repeated experts included."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}-{rank}".encode()))
    x = torch.randn(tokens, M, generator=g).to(dtype)
    indices = torch.randint(-1, num_experts, (tokens, top_k), generator=g)
    if tokens > 1 and top_k > 1:
        indices[1, 1] = indices[1, 0]  # one token names an expert twice
    gates = torch.rand(tokens, top_k, generator=g)
    return x, indices, gates


def tokens_of(rank: int, max_tokens: int) -> int:
    return (3 * rank + 1) % (max_tokens + 1)


def expert_function(global_expert: int, rows: torch.Tensor) -> torch.Tensor:
    """What expert e computes in these tests: rows * (e + 1), exact in every dtype here."""
    return rows * (global_expert + 1)


@pytest.mark.parametrize("dispatch_dtype", [None, "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("top_k,experts_per_rank", [(1, 1), (2, 2), (4, 3)])
def test_dispatch_and_combine_match_the_reference(comm, dispatch_dtype, dtype, top_k, experts_per_rank):
    if dispatch_dtype is not None and dtype == torch.float64:
        pytest.skip("FP8 dispatch of float64 is covered by float32")
    world, rank = comm.size, comm.rank
    num_experts, max_tokens = experts_per_rank * world, 6
    name = str(dtype).removeprefix("torch.")
    buffer = a2a.LowLatencyBuffer(comm, max_tokens, M, num_experts, top_k, name, dispatch_dtype=dispatch_dtype)
    tag = f"ll-{dispatch_dtype}-{name}-{top_k}"
    everyone = [inputs(tag, r, tokens_of(r, max_tokens), top_k, num_experts, dtype) for r in range(world)]
    if dispatch_dtype is not None:  # what travels: each source's FP8 round trip
        fmt = a2a.FP8_DTYPES[dispatch_dtype]
        everyone = [(a2a.dequantize_fp8(*a2a.quantize_fp8(x, format=fmt), dtype=name), i, g) for x, i, g in everyone]
    x, indices, gates = inputs(tag, rank, tokens_of(rank, max_tokens), top_k, num_experts, dtype)
    expert_x, counts = buffer.dispatch(x, indices)
    for e in range(experts_per_rank):
        expert = rank * experts_per_rank + e
        expected = [everyone[s][0][t] for s in range(world) for t in range(len(everyone[s][0]))
                    if expert in everyone[s][1][t].tolist()]
        assert int(counts[e]) == len(expected), f"rank {rank} expert {expert}"
        if expected:
            assert torch.equal(expert_x[e, : len(expected)], torch.stack(expected)), f"rank {rank} expert {expert} rows"
    out = torch.zeros_like(expert_x)
    for e in range(experts_per_rank):
        out[e] = expert_function(rank * experts_per_rank + e, expert_x[e])
    y = buffer.combine(out, gates)
    mine = everyone[rank][0].double()
    want = torch.zeros(len(x), M, dtype=torch.float64)
    for t in range(len(x)):
        for j in range(top_k):
            expert = int(indices[t, j])
            if expert >= 0:
                want[t] += float(gates[t, j]) * expert_function(expert, mine[t])
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    assert y.shape == (len(x), M) and y.dtype == dtype
    assert torch.allclose(y.double(), want, rtol=tolerance, atol=tolerance), f"rank {rank}"


def test_many_calls_and_token_counts(comm):
    """Calls reuse the buffers; each call's own T, 0 included."""
    world, rank = comm.size, comm.rank
    buffer = a2a.LowLatencyBuffer(comm, 5, M, 2 * world, 2, "float32")
    for call in range(6):
        tokens = (rank + call) % 6
        x, indices, gates = inputs(f"calls-{call}", rank, tokens, 2, 2 * world, torch.float32)
        expert_x, _counts = buffer.dispatch(x, indices)
        y = buffer.combine(expert_x.clone(), gates)
        want = (gates * (indices >= 0)).sum(dim=1, keepdim=True) * x
        for t in range(tokens):  # a repeated expert's row counts once per choice
            assert torch.allclose(y[t], want[t], atol=1e-5), f"call {call} rank {rank} token {t}"


@pytest.mark.parametrize("bad", ["too-many-tokens", "index-out-of-range", "expert-out-shape", "requires-grad"])
def test_bad_input_fails_on_every_rank_and_the_buffer_recovers(comm, bad):
    world, rank = comm.size, comm.rank
    culprit = world - 1
    buffer = a2a.LowLatencyBuffer(comm, 4, M, world, 1, "float32")
    x, indices, gates = inputs("bad", rank, 3, 1, world, torch.float32)
    if rank == culprit and bad == "too-many-tokens":
        x, indices, gates = inputs("bad", rank, 5, 1, world, torch.float32)
    if rank == culprit and bad == "index-out-of-range":
        indices[2, 0] = world + 7
    if rank == culprit and bad == "requires-grad":  # the dispatch records no autograd: refused, not dropped
        x.requires_grad_()
    error = None
    try:
        expert_x, _ = buffer.dispatch(x, indices)
        out = expert_x[:, :1].contiguous() if (rank == culprit and bad == "expert-out-shape") else expert_x.clone()
        buffer.combine(out, gates)
    except a2a.A2AError as caught:
        error = caught
    op = "low_latency_combine" if bad == "expert-out-shape" else "low_latency_dispatch"
    fragment = {"too-many-tokens": "up to 4", "index-out-of-range": f"indices[2, 0] = {world + 7}",
                "expert-out-shape": "expert_out must be", "requires-grad": "x requires grad"}[bad]
    if rank == culprit:
        assert isinstance(error, a2a.InvalidArgumentError) and op in str(error) and fragment in str(error), error
    else:
        assert isinstance(error, a2a.RemoteError), f"rank {rank}: {error!r}"
        assert f"rank(s) {culprit} rejected" in str(error)
    x, indices, gates = inputs("after", rank, 2, 1, world, torch.float32)
    expert_x, _ = buffer.dispatch(x, indices)  # the next call works
    y = buffer.combine(expert_x.clone(), gates)
    assert torch.allclose(y, gates * (indices >= 0) * x, atol=1e-6)


def test_calls_out_of_step_fail_with_a_mismatch(comm):
    """Rank 0 combines with no dispatch while the others dispatch."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    buffer = a2a.LowLatencyBuffer(comm, 4, M, comm.size, 1, "float32")
    x, indices, gates = inputs("step", comm.rank, 2, 1, comm.size, torch.float32)
    error = None
    try:
        if comm.rank == 0:
            buffer.combine(torch.zeros(1, comm.size * 4, M), gates)
        else:
            buffer.dispatch(x, indices)
    except a2a.A2AError as caught:
        error = caught
    if comm.rank == 0:
        assert isinstance(error, a2a.InvalidArgumentError) and "no dispatch precedes" in str(error)
    else:
        assert isinstance(error, a2a.MismatchError) and "from rank 0 belongs to another call" in str(error), error


def test_construction_is_agreed(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    error = None
    try:
        a2a.LowLatencyBuffer(comm, 4 + comm.rank % 2, M, comm.size, 1, "float32")
    except a2a.A2AError as caught:
        error = caught
    assert isinstance(error, a2a.MismatchError) and "max_tokens" in str(error)
    with pytest.raises(a2a.InvalidArgumentError, match="not a positive multiple"):  # every rank's own error
        a2a.LowLatencyBuffer(comm, 4, M, comm.size + 1, 1, "float32")


@pytest.mark.parametrize("argument", ["dtype", "dispatch_dtype", "model_dim"])
def test_a_rank_whose_own_arguments_are_wrong_fails_the_construction_on_every_rank(comm, argument):
    """Its arguments checked in Python, before the agreed construction: the
    other ranks hear of it there (RemoteError naming it) instead of waiting."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    wrong = comm.rank == comm.size - 1
    options = {"dtype": "float32", "dispatch_dtype": None, "model_dim": M}
    options[argument] = {"dtype": "int8", "dispatch_dtype": "float8_e3m4", "model_dim": 40.5}[argument] if wrong \
        else options[argument]
    with pytest.raises(a2a.A2AError) as caught:
        a2a.LowLatencyBuffer(comm, 4, options["model_dim"], comm.size, 1, options["dtype"],
                             dispatch_dtype=options["dispatch_dtype"])
    if wrong:
        assert isinstance(caught.value, a2a.InvalidArgumentError), caught.value
        assert f"LowLatencyBuffer on rank {comm.rank}: {argument}" in str(caught.value)
    else:
        assert isinstance(caught.value, a2a.RemoteError) and f"rank(s) {comm.size - 1}" in str(caught.value)
    a2a.LowLatencyBuffer(comm, 4, M, comm.size, 1, "float32")  # the communicator works on
