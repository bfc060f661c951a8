"""MoE routing under mpirun: a2a.route with a comm agrees on the capacity
(the maximum over ranks), rejects disagreeing or bad arguments on every rank
without hanging, and a whole MoE layer (route, fast_encode, all_to_all,
experts, all_to_all, fast_decode; and the dropless permute / all_to_all_v /
unpermute version) matches a single-process NumPy simulation of the world.

Every rank can build every rank's input (a function of the rank only), so
each rank computes the whole world's reference by itself. As everywhere in
tests/mpi, a test runs all its collectives before it asserts anything.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from a2a_mpi_util import check_bad_rank, check_mismatch, outcome

import a2a

TOP_K = 2


def rank_indices(tag, rank, num_experts, top_k=TOP_K):
    """Rank `rank`'s (T, k) choices: T and the popularity of the experts
    differ per rank, and some choices are unrouted."""
    num_tokens = 9 + 7 * rank
    return ref.moe_indices(
        f"{tag}-{rank}", num_tokens, top_k, num_experts, unrouted=0.1, skew=0.4 * (rank % 3)
    )


def world_capacity(tag, size, num_experts, **kwargs):
    """The capacity every rank must get: the largest local one."""
    local = []
    for r in range(size):
        routing = ref.ref_route(rank_indices(tag, r, num_experts), num_experts, **kwargs)
        local.append(routing.capacity)
    return max(local), local


def still_works(comm):
    """Runs a correct collective now; returns the check to run at the end."""
    x = ref.a2a_input("after-route-error", comm.rank, comm.size, (comm.size * 2, 3), "float32")
    expected = ref.a2a_expected("after-route-error", comm.rank, comm.size, (comm.size * 2, 3), "float32")
    result, error = outcome(lambda: a2a.all_to_all(x, comm=comm))

    def check():
        assert error is None, f"the comm does not work after the error: {error!r}"
        ref.assert_bitwise_equal(result, expected, "a collective after the error")

    return check


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_setting": 0},
        {"capacity_setting": -0.5},
        {"capacity_setting": -1.0},
        {"capacity_setting": 1.0},
        {"capacity_setting": 0.75},
        {},
        {"capacity": 3},
    ],
    ids=str,
)
def test_capacity_agreed_across_ranks(comm, kwargs):
    num_experts = 4
    tag = "agree"
    indices = rank_indices(tag, comm.rank, num_experts)
    routing, error = outcome(lambda: a2a.route(indices, num_experts, comm=comm, **kwargs))
    assert error is None, repr(error)
    capacity, local = world_capacity(tag, comm.size, num_experts, **kwargs)
    assert routing.capacity == capacity, f"rank {comm.rank}: capacity {routing.capacity}, local ones {local}"
    ref.assert_routing_matches(
        routing, ref.ref_route(indices, num_experts, capacity=capacity), f"rank {comm.rank}"
    )
    if kwargs.get("capacity_setting") == 0:
        assert routing.num_dropped == 0
    if comm.size > 1 and "capacity" not in kwargs:
        assert len(set(local)) > 1, f"the ranks' own capacities {local} do not differ: a weak test"


def test_capacity_setting_zero_is_the_largest_demand_anywhere(comm):
    """Rank r's 3 + 2r tokens all pick expert r % E with both choices: its
    largest demand is 2 (3 + 2r), so the last rank's decides."""
    num_experts = 3
    num_tokens = 3 + 2 * comm.rank
    indices = np.full((num_tokens, 2), comm.rank % num_experts, dtype=np.int32)
    routing = a2a.route(indices, num_experts, capacity_setting=0, comm=comm)
    assert routing.capacity == 2 * (3 + 2 * (comm.size - 1))
    assert routing.num_dropped == 0
    expected_counts = [0] * num_experts
    expected_counts[comm.rank % num_experts] = 2 * num_tokens
    assert ref.as_numpy(routing.counts).tolist() == expected_counts


def test_capped_capacity_is_the_maximum_of_the_local_caps(comm):
    """capacity_setting=-x: each rank's min(demand, ceil(k*x*T/E)), then the max."""
    num_experts = 4
    tag = "capped"
    indices = rank_indices(tag, comm.rank, num_experts)
    routing = a2a.route(indices, num_experts, capacity_setting=-0.25, comm=comm)
    capacity, local = world_capacity(tag, comm.size, num_experts, capacity_setting=-0.25)
    # The cap binds: ceil(2 * 0.25 * T / 4) is below the demand on the largest rank.
    last_t = 9 + 7 * (comm.size - 1)
    assert capacity == local[-1] == -(-2 * last_t // 16)
    assert routing.capacity == capacity


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_rank_without_tokens(comm, framework):
    """Rank 0 has no tokens (local capacity 0 for any setting); it still gets
    the world's capacity and an empty routing."""
    if framework == "torch":
        pytest.importorskip("torch")
    num_experts = 4
    indices = rank_indices("empty", comm.rank, num_experts)
    if comm.rank == 0:
        indices = indices[:0]
    routing = a2a.route(
        ref.to_framework(indices, "int64", framework), num_experts, capacity_setting=1.0, comm=comm
    )
    sizes = [0] + [9 + 7 * r for r in range(1, comm.size)]
    assert routing.capacity == max(-(-2 * t // num_experts) for t in sizes)
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, capacity=routing.capacity))
    x = np.ones((len(indices), 3), np.float32)
    dispatched = a2a.fast_encode(ref.to_framework(x, "float32", framework), routing)
    assert tuple(dispatched.shape) == (num_experts, routing.capacity, 3)


def test_route_with_batch_prioritized_and_comm(comm):
    num_experts = 4
    indices = rank_indices("bpr", comm.rank, num_experts)
    scores = np.random.default_rng(comm.rank).random(len(indices)).astype(np.float32)
    routing = a2a.route(
        indices, num_experts, capacity_setting=0.5, scores=scores, batch_prioritized=True, comm=comm
    )
    capacity, _ = world_capacity("bpr", comm.size, num_experts, capacity_setting=0.5)
    order = ref.ref_slot_order(scores)
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, capacity=capacity, order=order))


def test_num_experts_mismatch(comm, need_two):
    num_experts = 4 if comm.rank == 0 else 5
    indices = rank_indices("mismatch", comm.rank, 4)
    error = outcome(lambda: a2a.route(indices, num_experts, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "num_experts", "rank 0: 4", "rank 1: 5")
    after()


def test_top_k_mismatch(comm, need_two):
    indices = rank_indices("mismatch-k", comm.rank, 4, top_k=2 if comm.rank == 0 else 1)
    error = outcome(lambda: a2a.route(indices, 4, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "rank 0: 2", "rank 1: 1")
    after()


def test_capacity_setting_mismatch(comm, need_two):
    indices = rank_indices("mismatch-x", comm.rank, 4)
    setting = 1.0 if comm.rank == 0 else 2.0
    error = outcome(lambda: a2a.route(indices, 4, capacity_setting=setting, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "capacity_setting")
    after()


def test_capacity_mismatch(comm, need_two):
    indices = rank_indices("mismatch-c", comm.rank, 4)
    capacity = 3 if comm.rank == 0 else 4
    error = outcome(lambda: a2a.route(indices, 4, capacity=capacity, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "capacity")
    after()


def test_one_rank_with_an_index_out_of_range(comm):
    bad = comm.size - 1
    indices = rank_indices("bad-index", comm.rank, 4)
    if comm.rank == bad:
        indices[3, 1] = 4
    error = outcome(lambda: a2a.route(indices, 4, comm=comm))[1]
    after = still_works(comm)
    if comm.rank == bad:
        # Found by the core's scan, so the message names the choice (not
        # necessarily this rank, unlike checks made before the collective).
        assert isinstance(error, a2a.InvalidArgumentError), repr(error)
        assert "route" in str(error) and "indices[3, 1] = 4" in str(error), str(error)
    else:
        check_bad_rank(comm, bad, "route", error)
    after()


def test_one_rank_with_float_indices(comm):
    bad = 0
    indices = rank_indices("bad-dtype", comm.rank, 4)
    if comm.rank == bad:
        indices = indices.astype(np.float32)
    error = outcome(lambda: a2a.route(indices, 4, comm=comm))[1]
    after = still_works(comm)
    check_bad_rank(comm, bad, "route", error, "float32")
    after()


@pytest.mark.parametrize(
    "spoil, fragments",
    [
        (lambda indices: np.repeat(indices, 2, axis=1)[:, ::2], ["indices (", "not C-contiguous"]),
        (lambda indices: indices.tolist(), ["TypeError", "indices of type list"]),
    ],
    ids=["non-contiguous", "list"],
)
def test_one_rank_with_indices_the_binding_rejects(comm, spoil, fragments):
    """Problems only Python sees are raised on every rank, like the collectives' ones."""
    bad = comm.size // 2
    indices = rank_indices("bad-layout", comm.rank, 4)
    if comm.rank == bad:
        indices = spoil(indices)
    error = outcome(lambda: a2a.route(indices, 4, comm=comm))[1]
    after = still_works(comm)
    check_bad_rank(comm, bad, "route", error, *fragments)
    after()


def test_one_rank_with_a_capacity_too_large(comm):
    bad = comm.size - 1
    indices = rank_indices("bad-capacity", comm.rank, 4)
    capacity = 2**64 if comm.rank == bad else 3
    error = outcome(lambda: a2a.route(indices, 4, capacity=capacity, comm=comm))[1]
    after = still_works(comm)
    check_bad_rank(comm, bad, "route", error, f"capacity {2**64} is too large")
    after()


def rank_capacities(rank, num_experts):
    """Rank `rank`'s own per-expert capacities (0 among them)."""
    return np.array([(3 * rank + 5 * e) % 7 for e in range(num_experts)], dtype=np.int64)


def test_per_expert_capacities_agreed_across_ranks(comm):
    """Each expert's capacity is the maximum of the ranks' ones, on every rank."""
    num_experts = 5
    indices = rank_indices("per-expert", comm.rank, num_experts)
    routing, error = outcome(
        lambda: a2a.route(indices, num_experts, capacity=rank_capacities(comm.rank, num_experts), comm=comm)
    )
    assert error is None, repr(error)
    agreed = np.max([rank_capacities(r, num_experts) for r in range(comm.size)], axis=0)
    assert routing.per_expert and routing.capacity.tolist() == agreed.tolist(), f"rank {comm.rank}"
    ref.assert_routing_matches(routing, ref.ref_route(indices, num_experts, capacity=agreed), f"rank {comm.rank}")
    x = np.ones((len(indices), 3), np.float32)
    assert a2a.fast_encode(x, routing).shape == (int(agreed.sum()), 3)


def test_per_expert_and_one_capacity_mismatch(comm, need_two):
    """A rank that passes one capacity while the others pass one per expert."""
    indices = rank_indices("mismatch-per-expert", comm.rank, 4)
    capacity = 3 if comm.rank == 0 else [3, 3, 3, 3]
    error = outcome(lambda: a2a.route(indices, 4, capacity=capacity, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "capacity")
    after()


def test_per_expert_num_experts_mismatch(comm, need_two):
    num_experts = 4 if comm.rank == 0 else 5
    indices = rank_indices("mismatch-per-expert-e", comm.rank, 4)
    error = outcome(lambda: a2a.route(indices, num_experts, capacity=[2] * num_experts, comm=comm))[1]
    after = still_works(comm)
    check_mismatch(error, "num_experts", "rank 0: 4", "rank 1: 5")
    after()


@pytest.mark.parametrize(
    "capacity, fragments",
    [([1, 2, 3], ["capacity has 3 entries", "num_experts = 4"]), ([1, -2, 0, 1], ["capacity[1] must be >= 0"])],
    ids=["short", "negative"],
)
def test_one_rank_with_bad_per_expert_capacities(comm, capacity, fragments):
    bad = comm.size - 1
    indices = rank_indices("bad-per-expert", comm.rank, 4)
    error = outcome(lambda: a2a.route(indices, 4, capacity=capacity if comm.rank == bad else [2] * 4, comm=comm))[1]
    after = still_works(comm)
    check_bad_rank(comm, bad, "route", error, *fragments)
    after()


def test_route_works_after_errors(comm):
    indices = rank_indices("after", comm.rank, 4)
    routing = a2a.route(indices, 4, capacity_setting=0, comm=comm)
    capacity, _ = world_capacity("after", comm.size, 4, capacity_setting=0)
    assert routing.capacity == capacity


# ---------------------------------------------------------------------------
# A whole MoE layer across the ranks. Expert e multiplies its rows by e + 1.

LOCAL_EXPERTS = 2
MODEL_DIM = 6


def layer_inputs(tag, rank, num_experts, dtype):
    """x, gates (dyadic: every value of the layer is exact) and choices of one rank."""
    indices = rank_indices(tag, rank, num_experts)
    x = ref.moe_data(f"{tag}-x-{rank}", (len(indices), MODEL_DIM), dtype, "dyadic")
    gates = ref.moe_gates(f"{tag}-g-{rank}", indices.shape, dtype, "dyadic")
    return x, gates, indices


def apply_experts(received, first_expert):
    """received (sources, L, C, M) on the rank that owns experts
    first_expert .. first_expert + L - 1."""
    scale = np.arange(first_expert + 1, first_expert + received.shape[1] + 1, dtype=received.dtype)
    return received * scale[None, :, None, None]


def simulate_padded_layer(tag, size, num_experts, dtype, capacity_setting):
    """Every rank's y, computed in one process with the NumPy references."""
    capacity, _ = world_capacity(tag, size, num_experts, capacity_setting=capacity_setting)
    routings, dispatched = [], []
    for r in range(size):
        x, gates, indices = layer_inputs(tag, r, num_experts, dtype)
        routing = ref.ref_route(indices, num_experts, capacity=capacity)
        routings.append((routing, gates))
        dispatched.append(ref.ref_encode(x, routing, gates))
    received = ref.ref_all_to_all(dispatched)
    processed = [
        apply_experts(buf.reshape(size, LOCAL_EXPERTS, capacity, MODEL_DIM), r * LOCAL_EXPERTS).reshape(
            buf.shape
        )
        for r, buf in enumerate(received)
    ]
    returned = ref.ref_all_to_all(processed)
    return [ref.ref_decode(returned[r], routing, None) for r, (routing, _) in enumerate(routings)], capacity


def direct_layer(x, gates, row_map, indices, dtype):
    """y[t] = sum over kept choices of gate * (e + 1) * x[t]."""
    kept = row_map >= 0
    factor = np.where(kept, gates.astype(np.float64) * (indices + 1), 0.0).sum(axis=1)
    return (factor[:, None] * x.astype(np.float64)).astype(dtype)


@pytest.mark.parametrize("capacity_setting", [1.0, 0.5, 0])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_moe_layer_with_capacity(comm, dtype, capacity_setting):
    num_experts = comm.size * LOCAL_EXPERTS
    tag = f"layer-{capacity_setting}"
    x, gates, indices = layer_inputs(tag, comm.rank, num_experts, dtype)
    routing = a2a.route(indices, num_experts, capacity_setting=capacity_setting, comm=comm)
    dispatched = a2a.fast_encode(x, routing, gates=gates)  # (E, C, M)
    received = a2a.all_to_all(dispatched, comm=comm)  # (sources * L, C, M)
    capacity = routing.capacity
    first = comm.rank * LOCAL_EXPERTS
    processed = apply_experts(received.reshape(comm.size, LOCAL_EXPERTS, capacity, MODEL_DIM), first)
    returned = a2a.all_to_all(np.ascontiguousarray(processed.reshape(received.shape)), comm=comm)
    y = a2a.fast_decode(returned, routing)

    expected, expected_capacity = simulate_padded_layer(tag, comm.size, num_experts, dtype, capacity_setting)
    assert capacity == expected_capacity
    ref.assert_bitwise_equal(y, expected[comm.rank], f"rank {comm.rank} y")
    np.testing.assert_array_equal(y, direct_layer(x, gates, ref.as_numpy(routing.row_map), indices, dtype))
    if capacity_setting == 0:
        assert routing.num_dropped == 0


def test_moe_layer_with_capacity_torch(comm, torch):
    """The same layer with torch tensors, gates applied at decode."""
    num_experts = comm.size * LOCAL_EXPERTS
    tag = "layer-torch"
    x_np, gates_np, indices_np = layer_inputs(tag, comm.rank, num_experts, "float32")
    x, gates, indices = (torch.from_numpy(a) for a in (x_np, gates_np, indices_np))
    routing = a2a.route(indices, num_experts, capacity_setting=1.0, comm=comm)
    dispatched = a2a.fast_encode(x, routing)
    received = a2a.all_to_all(dispatched, comm=comm)
    c = routing.capacity
    scale = torch.arange(1, LOCAL_EXPERTS + 1, dtype=torch.float32) + comm.rank * LOCAL_EXPERTS
    processed = (received.view(comm.size, LOCAL_EXPERTS, c, MODEL_DIM) * scale.view(1, -1, 1, 1)).reshape(
        received.shape
    )
    y = a2a.fast_decode(a2a.all_to_all(processed.contiguous(), comm=comm), routing, gates=gates)
    assert isinstance(y, torch.Tensor)
    expected, _ = simulate_padded_layer(tag, comm.size, num_experts, "float32", 1.0)
    ref.assert_bitwise_equal(y, expected[comm.rank], f"rank {comm.rank} y")


def simulate_dropless_layer(tag, size, num_experts, dtype):
    """Every rank's y for the dropless layer, in one process."""
    perms, sorted_rows, counts = [], [], []
    for r in range(size):
        x, gates, indices = layer_inputs(tag, r, num_experts, dtype)
        perm = ref.ref_route(indices, num_experts, dropless=True)
        perms.append((perm, gates))
        sorted_rows.append(ref.ref_permute(x, perm))
        counts.append(perm.counts)
    # send_counts[src][dst]: rows of dst's experts on src.
    send = np.array([c.reshape(size, LOCAL_EXPERTS).sum(axis=1) for c in counts])
    received = ref.ref_all_to_all_v(sorted_rows, send)
    processed = []
    for dst, (rows, _) in enumerate(received):
        out, start = rows.copy(), 0
        for src in range(size):
            for local in range(LOCAL_EXPERTS):
                n = counts[src][dst * LOCAL_EXPERTS + local]
                out[start : start + n] *= dst * LOCAL_EXPERTS + local + 1
                start += n
        processed.append(out)
    returned = ref.ref_all_to_all_v(processed, send.T)
    return [ref.ref_unpermute(returned[r][0], perm, gates) for r, (perm, gates) in enumerate(perms)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dropless_moe_layer(comm, dtype):
    num_experts = comm.size * LOCAL_EXPERTS
    tag = "dropless"
    x, gates, indices = layer_inputs(tag, comm.rank, num_experts, dtype)
    x_sorted, perm = a2a.permute(x, indices, num_experts)
    counts = ref.as_numpy(perm.counts)
    send_counts = counts.reshape(comm.size, LOCAL_EXPERTS).sum(axis=1)
    # Each rank learns how many rows every source has for each of its experts.
    expert_counts = a2a.all_to_all(counts.astype(np.int64), comm=comm).reshape(comm.size, LOCAL_EXPERTS)
    received, recv_counts = a2a.all_to_all_v(x_sorted, send_counts, comm=comm)
    processed, start = received.copy(), 0
    for src in range(comm.size):
        for local in range(LOCAL_EXPERTS):
            n = int(expert_counts[src, local])
            processed[start : start + n] *= comm.rank * LOCAL_EXPERTS + local + 1
            start += n
    returned, back_counts = a2a.all_to_all_v(processed, recv_counts, comm=comm)
    y = a2a.unpermute(returned, perm, gates=gates)

    assert start == received.shape[0] == int(recv_counts.sum())
    assert back_counts.tolist() == send_counts.tolist()
    assert perm.num_dropped == 0
    expected = simulate_dropless_layer(tag, comm.size, num_experts, dtype)
    ref.assert_bitwise_equal(y, expected[comm.rank], f"rank {comm.rank} y")
    np.testing.assert_array_equal(y, direct_layer(x, gates, ref.as_numpy(perm.row_map), indices, dtype))
