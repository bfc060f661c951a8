"""Tutel's low-level ops (moe_runtime.moe.ops: extract_critical, fast_encode,
fast_decode, fast_dispatcher, fast_cumsum_sub_one) against a plain float64
torch reference of Tutel's semantics written here: top-k, gates, slot order,
capacity rule, encode and decode with the gates before or after the experts,
and their gradients (through the data and back to the scores)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from moe_runtime.gating.losses import gshard_loss
from moe_runtime.moe import ops

TOKENS = (1, 7, 37, 1000)
EXPERTS = (1, 3, 8)
TOP_K = (1, 2, 3)
# (capacity_factor, alignment): dropping, rounding, drop-nothing (f == 0) and bounded (f < 0).
CAPACITIES = [(1.0, 1), (0.3, 4), (0.0, 1), (0.0, 8), (-0.5, 1), (2.0, 3)]
MODEL_DIM = 5
TOLERANCE = {  # (rtol, atol) against the float64 reference of the same inputs
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_scores(tokens: int, experts: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    logits = torch.randn(tokens, experts, generator=generator(seed), dtype=torch.float64) * 2
    return torch.softmax(logits, dim=1).to(dtype)


def random_rows(rows: int, seed: int = 1, dtype=torch.float64, columns: int = MODEL_DIM) -> torch.Tensor:
    return torch.randn(rows, columns, generator=generator(seed), dtype=torch.float64).to(dtype)


# --- the reference -------------------------------------------------------------------------------


def reference_routing(scores, top_k, capacity_factor=1.0, batch_prioritized=False, normalize_gate=True,
                      alignment=1, num_samples=None, most_chosen=None):
    """Tutel's extract_critical in float64: (indices (T, k), locations (T, k),
    gates (T, k), capacity, counts (E,)); differentiable in scores.
    num_samples / most_chosen: the group's maxima (default: this rank's)."""
    s = scores.double()
    tokens, experts = s.shape
    k = min(top_k, experts)
    indices = torch.topk(s, k, dim=1).indices
    gates = s.gather(1, indices)
    if normalize_gate and k > 1:
        gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(scores.dtype).eps)
    if batch_prioritized:
        order = torch.argsort(-s.detach().amax(dim=1), stable=True)
    else:
        order = torch.arange(tokens)
    locations = torch.zeros(tokens, k, dtype=torch.int64)
    taken = torch.zeros(experts, dtype=torch.int64)  # slots given out by the earlier choices
    for j in range(k):
        mask = torch.nn.functional.one_hot(indices[:, j], experts)
        in_order = torch.cumsum(mask[order], dim=0) - 1
        slot = (in_order * mask[order]).sum(dim=1)
        locations[order, j] = slot + taken[indices[order, j]]
        taken += mask.sum(dim=0)
    counts = taken
    samples = tokens if num_samples is None else num_samples
    per_expert = -(-samples // experts)
    most = int(counts.max()) if most_chosen is None else most_chosen
    if capacity_factor > 0:
        capacity = k * int(capacity_factor * per_expert)
    else:
        capacity = most
        if capacity_factor < 0:
            capacity = min(capacity, k * int(-capacity_factor * per_expert))
    capacity = -(-capacity // alignment) * alignment
    return indices, locations, gates, capacity, counts


def reference_encode(x, indices, locations, gates, capacity, experts, gated):
    """(T, M) -> (E, C, M) in float64, differentiable in x and gates."""
    x = x.double()
    out = x.new_zeros(experts * capacity, x.shape[1])
    for j in range(indices.shape[1]):
        kept = locations[:, j] < capacity
        rows = indices[kept, j] * capacity + locations[kept, j]
        value = x[kept] * (gates[kept, j : j + 1] if gated else 1.0)
        out = out.index_add(0, rows, value)
    return out.view(experts, capacity, x.shape[1])


def reference_decode(buffer, indices, locations, gates, capacity, gated):
    """(E, C, M) -> (T, M) in float64, differentiable in buffer and gates."""
    rows_of = buffer.double().reshape(-1, buffer.shape[-1])
    y = rows_of.new_zeros(indices.shape[0], buffer.shape[-1])
    for j in range(indices.shape[1]):
        kept = (locations[:, j] < capacity).double().unsqueeze(1)
        rows = (indices[:, j] * capacity + locations[:, j].clamp(max=max(capacity - 1, 0))).clamp(min=0)
        picked = rows_of[rows] if rows_of.shape[0] else rows_of.sum() * y  # no rows: zeros, in the graph
        y = y + kept * picked * (gates[:, j : j + 1] if gated else 1.0)
    return y


def reference_loss(scores, indices):
    """GShard's loss as Tutel writes it: sum_e (sum_t scores) * (E / T * first choices) / T."""
    tokens, experts = scores.shape
    first = torch.nn.functional.one_hot(indices[:, 0], experts).double() * (experts / tokens)
    return (scores.double().sum(dim=0) * first.sum(dim=0)).sum() / tokens


def stacked(tensors):
    return torch.stack([t.long() if not t.is_floating_point() else t for t in tensors], dim=1)


def check_crit(crit, expected, experts):
    indices, locations, gates, capacity, counts = expected
    num_experts, indices_s, locations_s, gates_s, crit_capacity, dispatch_count = crit
    assert isinstance(crit, tuple) and len(crit) == 6
    assert num_experts == experts and isinstance(num_experts, int)
    assert crit_capacity == capacity and isinstance(crit_capacity, int)
    assert len(indices_s) == len(locations_s) == len(gates_s) == indices.shape[1]
    assert all(t.dtype == torch.int32 and t.shape == (indices.shape[0],) for t in (*indices_s, *locations_s))
    assert torch.equal(stacked(indices_s), indices)
    assert torch.equal(stacked(locations_s), locations)
    torch.testing.assert_close(stacked(gates_s).double(), gates.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch_count, counts)


# --- extract_critical ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_prioritized", [False, True], ids=["token-order", "batch-prioritized"])
@pytest.mark.parametrize("factor,alignment", CAPACITIES, ids=[f"f{f}-a{a}" for f, a in CAPACITIES])
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_extract_critical_matches_reference(tokens, experts, top_k, factor, alignment, batch_prioritized):
    scores = random_scores(tokens, experts, seed=tokens * 31 + experts)
    crit, l_loss = ops.extract_critical(scores, top_k, capacity_factor=factor, alignment=alignment,
                                        batch_prioritized_routing=batch_prioritized)
    expected = reference_routing(scores, top_k, factor, batch_prioritized, alignment=alignment)
    check_crit(crit, expected, experts)
    assert isinstance(crit, ops.CriticalData)
    routing = crit.routing
    assert routing.num_rows == experts * expected[3] and routing.num_tokens == tokens
    torch.testing.assert_close(l_loss, reference_loss(scores, expected[0]), rtol=1e-12, atol=1e-12)
    if factor == 0:  # drop nothing
        assert crit.routing.num_dropped == 0


@pytest.mark.parametrize("normalize_gate", [True, False])
@pytest.mark.parametrize("top_k", TOP_K)
def test_gates_normalized_over_the_k_choices(top_k, normalize_gate):
    scores = random_scores(37, 8, seed=3, dtype=torch.float32)
    crit, _ = ops.extract_critical(scores, top_k, normalize_gate=normalize_gate)
    expected = reference_routing(scores, top_k, normalize_gate=normalize_gate)
    check_crit(crit, expected, 8)
    assert all(g.dtype == torch.float32 for g in crit[3])
    if normalize_gate and top_k > 1:
        torch.testing.assert_close(sum(crit[3]), torch.ones(37))


def test_normalization_divides_by_eps_at_least():
    scores = torch.zeros(4, 3)  # every gate 0: the sum is clamped to eps, as in Tutel
    crit, _ = ops.extract_critical(scores, 2)
    assert all(torch.equal(g, torch.zeros(4)) for g in crit[3])


def test_top_k_above_experts_is_clamped():
    scores = random_scores(7, 3)
    crit, _ = ops.extract_critical(scores, 5)
    check_crit(crit, reference_routing(scores, 3), 3)
    assert len(crit[1]) == 3


def test_loss_fn():
    scores = random_scores(37, 8).requires_grad_()
    seen = []

    def loss_fn(s, topk_ids):
        seen.append(topk_ids)
        return s.sum() * 0 + 7.0

    _, default = ops.extract_critical(scores, 2)
    assert torch.equal(default, gshard_loss(scores, torch.topk(scores, 2, dim=1).indices))
    _, custom = ops.extract_critical(scores, 2, loss_fn=loss_fn)
    assert float(custom.detach()) == 7.0 and seen[0].shape == (37, 2) and seen[0].dtype == torch.int64
    _, none = ops.extract_critical(scores, 2, loss_fn=None)
    assert none is None
    default.backward()
    assert scores.grad is not None


def test_top_k_routing_is_extract_critical():
    assert ops.top_k_routing is ops.extract_critical


def test_dispatch_count_is_counted_before_the_capacity():
    scores = random_scores(1000, 8, seed=5)
    for batch_prioritized in (False, True):
        crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.2, batch_prioritized_routing=batch_prioritized)
        counts = torch.bincount(torch.topk(scores, 2, dim=1).indices.reshape(-1), minlength=8)
        assert torch.equal(crit[5], counts) and int(counts.sum()) == 2000
        assert crit.routing.num_dropped == 2000 - int(torch.clamp(counts, max=crit[4]).sum())


def test_capacity_zero_drops_everything():
    """A factor small enough for int(f * ceil(T / E)) == 0: capacity 0, as Tutel, and an empty buffer."""
    scores = random_scores(7, 3).requires_grad_()
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.1)
    assert crit[4] == 0
    x = random_rows(7).requires_grad_()
    dispatched = ops.fast_encode(x, crit)
    assert dispatched.shape == (3, 0, MODEL_DIM)
    y = ops.fast_decode(dispatched, crit)
    assert torch.equal(y, torch.zeros(7, MODEL_DIM, dtype=torch.float64))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_no_tokens():
    scores = torch.empty(0, 4)
    crit, _ = ops.extract_critical(scores, 2, loss_fn=None)
    assert crit[4] == 0 and crit[1][0].shape == (0,)
    assert ops.fast_encode(torch.empty(0, 3), crit).shape == (4, 0, 3)
    assert ops.fast_decode(torch.empty(4, 0, 3), crit).shape == (0, 3)


def test_inequivalent_tokens_and_group(comm):
    """On one rank the group's maxima are the rank's own values, whether the group is None or an a2a.Comm."""
    scores = random_scores(37, 8, seed=9)
    base = reference_routing(scores, 2, 0.0)
    for group in (None, comm):
        for factor in (0.0, -0.5, 1.0):
            crit, _ = ops.extract_critical(scores, 2, capacity_factor=factor, group=group, inequivalent_tokens=True)
            check_crit(crit, reference_routing(scores, 2, factor), 8)
    assert base[3] == int(base[4].max())


# --- fast_encode / fast_decode -------------------------------------------------------------------


@pytest.mark.parametrize("is_postscore", [True, False], ids=["postscore", "prescore"])
@pytest.mark.parametrize("factor", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_encode_decode_and_gradients_match_reference(tokens, experts, top_k, factor, is_postscore):
    scores = random_scores(tokens, experts, seed=tokens + 7 * experts).requires_grad_()
    x = random_rows(tokens, seed=tokens).requires_grad_()
    crit, _ = ops.extract_critical(scores, top_k, capacity_factor=factor, loss_fn=None)
    dispatched = ops.fast_encode(x, crit, is_postscore)
    expert_out = torch.tanh(dispatched) * 2  # an "expert": decode's input depends on encode's output
    y = ops.fast_decode(expert_out.contiguous(), crit, is_postscore)
    upstream = random_rows(tokens, seed=99)
    (y * upstream).sum().backward()

    scores_ref = scores.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    indices, locations, gates, capacity, _ = reference_routing(scores_ref, top_k, factor)
    dispatched_ref = reference_encode(x_ref, indices, locations, gates, capacity, experts, not is_postscore)
    y_ref = reference_decode(torch.tanh(dispatched_ref) * 2, indices, locations, gates, capacity, is_postscore)
    (y_ref * upstream).sum().backward()

    assert dispatched.shape == (experts, capacity, MODEL_DIM)
    torch.testing.assert_close(dispatched, dispatched_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scores.grad, scores_ref.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("is_postscore", [True, False], ids=["postscore", "prescore"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gate_dtype", [torch.float32, "data"], ids=["f32-gates", "data-gates"])
def test_dtypes(dtype, gate_dtype, is_postscore):
    """Each dtype against the float64 reference of the same (rounded) inputs."""
    tokens, experts = 37, 8
    gate_dtype = dtype if gate_dtype == "data" else gate_dtype
    scores = random_scores(tokens, experts, seed=4).to(gate_dtype).requires_grad_()
    x = random_rows(tokens, dtype=dtype).requires_grad_()
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5, loss_fn=None)
    assert crit.routing.num_dropped > 0
    dispatched = ops.fast_encode(x, crit, is_postscore)
    y = ops.fast_decode(dispatched, crit, is_postscore)
    assert dispatched.dtype == y.dtype == dtype
    upstream = random_rows(tokens, seed=5)
    (y.double() * upstream).sum().backward()

    gates = torch.stack(crit[3], dim=1).detach().double().requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    indices, locations = torch.stack(crit[1], 1).long(), torch.stack(crit[2], 1).long()
    dispatched_ref = reference_encode(x_ref, indices, locations, gates, crit[4], experts, not is_postscore)
    y_ref = reference_decode(dispatched_ref, indices, locations, gates, crit[4], is_postscore)
    (y_ref * upstream).sum().backward()
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(dispatched.double(), dispatched_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(y.double(), y_ref, rtol=2 * rtol, atol=2 * atol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=2 * rtol, atol=2 * atol)
    assert x.grad.dtype == dtype and scores.grad.dtype == gate_dtype


@pytest.mark.parametrize("batch_prioritized", [False, True], ids=["token-order", "batch-prioritized"])
@pytest.mark.parametrize("is_postscore", [True, False], ids=["postscore", "prescore"])
def test_gradcheck_through_routing(is_postscore, batch_prioritized):
    """Data and logits -> scores -> extract_critical -> encode -> expert -> decode, in float64."""
    logits = torch.randn(7, 3, generator=generator(11), dtype=torch.float64).requires_grad_()
    x = random_rows(7, columns=3).requires_grad_()

    def layer(x, logits):
        scores = torch.softmax(logits, dim=1)
        crit, l_loss = ops.extract_critical(scores, 2, capacity_factor=0.7,
                                            batch_prioritized_routing=batch_prioritized)
        assert crit.routing.num_dropped > 0
        dispatched = ops.fast_encode(x, crit, is_postscore)
        return ops.fast_decode(torch.sin(dispatched), crit, is_postscore), l_loss

    assert torch.autograd.gradcheck(layer, (x, logits))


@pytest.mark.parametrize("is_postscore", [True, False], ids=["postscore", "prescore"])
def test_gradcheck_data_and_gates(is_postscore):
    """fast_encode / fast_decode in their data and gates, crit rebuilt as a plain tuple with new gates."""
    crit, _ = ops.extract_critical(random_scores(9, 4, seed=2), 3, capacity_factor=0.6)
    assert crit.routing.num_dropped > 0
    x = random_rows(9, columns=2).requires_grad_()
    gates = [torch.rand(9, generator=generator(j), dtype=torch.float64).requires_grad_() for j in range(3)]
    buffer = torch.randn(4, crit[4], 2, generator=generator(3), dtype=torch.float64).requires_grad_()

    def encode(x, *gates):
        return ops.fast_encode(x, (crit[0], crit[1], crit[2], list(gates), crit[4], crit[5]), is_postscore)

    def decode(buffer, *gates):
        return ops.fast_decode(buffer, (crit[0], crit[1], crit[2], list(gates), crit[4], crit[5]), is_postscore)

    assert torch.autograd.gradcheck(encode, (x, *gates))
    assert torch.autograd.gradcheck(decode, (buffer, *gates))


def test_dropped_choices_contribute_nothing():
    scores = random_scores(1000, 8, seed=12)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.25)
    locations = torch.stack(crit[2], 1)
    dropped = locations >= crit[4]
    assert dropped.any() and (~dropped).any()
    x = random_rows(1000).requires_grad_()
    dispatched = ops.fast_encode(x, crit)
    y = ops.fast_decode(dispatched, crit)
    gates = torch.stack(crit[3], 1)
    expected = x.detach() * (gates * ~dropped).sum(dim=1, keepdim=True)  # identity experts
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    lost = dropped.all(dim=1)
    assert lost.any() and torch.equal(x.grad[lost], torch.zeros_like(x.grad[lost]))
    assert (dispatched.abs().sum(dim=2) > 0).sum() == (~dropped).sum()


def test_data_of_other_shapes():
    """Tutel reads data as rows of M: (B, S, M) tokens and (E * C, M) expert rows work."""
    crit, _ = ops.extract_critical(random_scores(12, 3), 2)
    x = random_rows(12)
    dispatched = ops.fast_encode(x.view(3, 4, MODEL_DIM), crit)
    assert torch.equal(dispatched, ops.fast_encode(x, crit))
    flat = dispatched.reshape(-1, MODEL_DIM)
    assert torch.equal(ops.fast_decode(flat, crit), ops.fast_decode(dispatched, crit))


# --- crit built or edited by a program -----------------------------------------------------------


def test_plain_tuple_crit():
    scores = random_scores(37, 8, seed=13)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5)
    x = random_rows(37)
    expected = ops.fast_decode(ops.fast_encode(x, crit, False), crit)
    plain = tuple(crit)
    assert type(plain) is tuple
    torch.testing.assert_close(ops.fast_decode(ops.fast_encode(x, plain, False), plain), expected)
    # Built from the reference: new tensors, routed again and checked.
    indices, locations, gates, capacity, counts = reference_routing(scores, 2, 0.5)
    built = (8, [indices[:, j].int() for j in range(2)], [locations[:, j].int() for j in range(2)],
             [gates[:, j] for j in range(2)], capacity, counts)
    torch.testing.assert_close(ops.fast_decode(ops.fast_encode(x, built, False), built), expected)
    # Dropped choices may carry any location at or past the capacity.
    moved = [torch.where(t >= capacity, t + 100, t) for t in built[2]]
    again = (8, built[1], moved, built[3], capacity, counts)
    torch.testing.assert_close(ops.fast_decode(ops.fast_encode(x, again, False), again), expected)


def test_plain_tuple_with_another_capacity():
    scores = random_scores(37, 8, seed=14)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5)
    wider = crit[:4] + (crit[4] + 3, crit[5])
    indices, locations, gates, _, _ = reference_routing(scores, 2)
    x = random_rows(37)
    dispatched = ops.fast_encode(x, wider)
    torch.testing.assert_close(dispatched, reference_encode(x, indices, locations, gates, crit[4] + 3, 8, False))


def test_wrong_locations_are_refused():
    crit, _ = ops.extract_critical(random_scores(37, 8, seed=15), 2, capacity_factor=2.0)
    swapped = [crit[2][0].flip(0), crit[2][1]]
    with pytest.raises(ValueError, match=r"locations_s\[0\]\[\d+\] = \d+, but a2a.route puts choice 0"):
        ops.fast_encode(random_rows(37), crit[:2] + (swapped,) + crit[3:])


def test_crit_edited_in_place_is_routed_again():
    crit, _ = ops.extract_critical(random_scores(37, 8, seed=16), 2, capacity_factor=2.0)
    x = random_rows(37)
    before = ops.fast_encode(x, crit)
    crit[2][1][0] += 1  # the routing remembered for these tensors no longer describes them
    with pytest.raises(ValueError, match="locations_s"):
        ops.fast_encode(x, crit)
    crit[2][1][0] -= 1
    assert torch.equal(ops.fast_encode(x, crit), before)


def test_batch_prioritized_crit():
    """Its routing rides with its tensors (plain tuples of them, copies, pickles); new tensors
    of the same values cannot tell their token order, and are refused."""
    scores = random_scores(37, 3, seed=17)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5, batch_prioritized_routing=True)
    indices, locations, gates, capacity, _ = reference_routing(scores, 2, 0.5, batch_prioritized=True)
    token_order = reference_routing(scores, 2, 0.5)[1]
    assert not torch.equal(locations, token_order)
    x = random_rows(37)
    expected = reference_encode(x, indices, locations, gates, capacity, 3, True)
    for same in (crit, tuple(crit), copy.deepcopy(crit), pickle.loads(pickle.dumps(crit))):
        torch.testing.assert_close(ops.fast_encode(x, same, False), expected)
    cloned = (3, [t.clone() for t in crit[1]], [t.clone() for t in crit[2]], crit[3], crit[4], crit[5])
    with pytest.raises(ValueError, match="batch-prioritized"):
        ops.fast_encode(x, cloned)


def test_batch_prioritized_crit_with_another_capacity():
    scores = random_scores(37, 3, seed=18)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5, batch_prioritized_routing=True)
    dispatcher = ops.fast_dispatcher(3, crit[4], MODEL_DIM, torch.float64)
    dispatcher.update(*crit[1:4], capacity=crit[4] + 5)
    indices, locations, gates, _, _ = reference_routing(scores, 2, batch_prioritized=True)
    x = random_rows(37)
    expected = reference_encode(x, indices, locations, gates, crit[4] + 5, 3, False)
    torch.testing.assert_close(dispatcher.encode(x), expected.view(-1, MODEL_DIM))


# --- fast_dispatcher -----------------------------------------------------------------------------


@pytest.mark.parametrize("is_postscore", [True, False], ids=["postscore", "prescore"])
def test_fast_dispatcher_round_trip(is_postscore):
    scores = random_scores(37, 8, seed=19)
    crit, _ = ops.extract_critical(scores, 2, capacity_factor=0.5)
    dispatcher = ops.fast_dispatcher(8, crit[4], MODEL_DIM, torch.float64)
    dispatcher.update(crit[1], crit[2], crit[3], capacity=crit[4], is_postscore=is_postscore)
    x = random_rows(37).requires_grad_()
    rows = dispatcher.encode(x)
    assert rows.shape == (8 * crit[4], MODEL_DIM)
    assert torch.equal(rows, ops.fast_encode(x, crit, is_postscore).view(-1, MODEL_DIM))
    y = dispatcher.decode(rows)
    assert y.shape == (37, MODEL_DIM)
    assert torch.equal(y, ops.fast_decode(rows.view(8, crit[4], MODEL_DIM), crit, is_postscore))
    locations = torch.stack(crit[2], 1)
    expected = x.detach() * (torch.stack(crit[3], 1) * (locations < crit[4])).sum(dim=1, keepdim=True)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert x.grad is not None


def test_fast_dispatcher_dtype_and_capacity():
    crit, _ = ops.extract_critical(random_scores(37, 8, seed=20), 2)
    dispatcher = ops.fast_dispatcher(8, crit[4], MODEL_DIM, torch.float32)
    dispatcher.update(*crit[1:-1])  # capacity None (or 0): the dispatcher's
    assert dispatcher.capacity == crit[4]
    x = random_rows(37)
    rows = dispatcher.encode(x)  # converted to the dispatch dtype, as Tutel
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, ops.fast_encode(x.float(), crit).view(-1, MODEL_DIM))
    assert dispatcher.decode(rows.double()).dtype == torch.float32
    with pytest.raises(RuntimeError, match="update"):
        ops.fast_dispatcher(8, 4, MODEL_DIM, torch.float32).encode(x)
    with pytest.raises(ValueError, match="dispatch_dtype"):
        ops.fast_dispatcher(8, 4, MODEL_DIM, torch.int32)
    with pytest.raises(ValueError, match=r"\(37, 5\)"):
        dispatcher.encode(random_rows(37, columns=4))


# --- fast_cumsum_sub_one -------------------------------------------------------------------------


def test_fast_cumsum_sub_one():
    indices = torch.tensor([2, 0, 2, 1, 2, 0])
    mask = torch.nn.functional.one_hot(indices, 3)
    result = ops.fast_cumsum_sub_one(mask)
    assert result.dtype == torch.int64
    assert result.gather(1, indices[:, None]).view(-1).tolist() == [0, 0, 1, 0, 2, 1]
    assert torch.equal(ops.fast_cumsum_sub_one(mask.t(), dim=1), result.t())
    with pytest.raises(TypeError):
        ops.fast_cumsum_sub_one([1, 2])


# --- errors --------------------------------------------------------------------------------------


def test_bad_arguments_of_extract_critical():
    scores = random_scores(7, 3)
    with pytest.raises(ValueError, match="scores"):
        ops.extract_critical(scores[0], 1)
    with pytest.raises(ValueError, match="scores"):
        ops.extract_critical(torch.ones(7, 3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="no experts"):
        ops.extract_critical(torch.ones(7, 0), 1)
    with pytest.raises(ValueError, match="top_k"):
        ops.extract_critical(scores, 0)
    with pytest.raises(TypeError, match="top_k"):
        ops.extract_critical(scores, 1.5)
    with pytest.raises(ValueError, match="alignment"):
        ops.extract_critical(scores, 1, alignment=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ops.extract_critical(scores, 1, capacity_factor=float("nan"))


def test_bad_data():
    crit, _ = ops.extract_critical(random_scores(7, 3), 2)
    x = random_rows(7)
    with pytest.raises(ValueError, match="contiguous"):
        ops.fast_encode(random_rows(MODEL_DIM, columns=7).t(), crit)
    dispatched = ops.fast_encode(x, crit)
    with pytest.raises(ValueError, match="contiguous"):
        ops.fast_decode(dispatched.transpose(0, 1), crit)
    with pytest.raises(ValueError, match=r"\(7, M\)"):
        ops.fast_encode(random_rows(6), crit)
    with pytest.raises(ValueError, match=r"\(7, M\)"):
        ops.fast_encode(torch.zeros(7 * MODEL_DIM, dtype=torch.float64), crit)
    with pytest.raises(ValueError, match=r"\(\d+, M\)"):
        ops.fast_decode(dispatched[:, :-1].contiguous(), crit)
    with pytest.raises(ValueError, match="float32"):
        ops.fast_encode(x.long(), crit)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.fast_encode(x.numpy(), crit)


def test_bad_crit():
    crit, _ = ops.extract_critical(random_scores(7, 3), 2)
    x = random_rows(7)
    with pytest.raises(TypeError, match="critial_data"):
        ops.fast_encode(x, crit[:5])
    with pytest.raises(TypeError, match="gates_s"):
        ops.fast_decode(ops.fast_encode(x, crit), crit[:3] + ([crit[3][0]],) + crit[4:])
    with pytest.raises(ValueError, match="experts 0..3; expected 0..2"):
        ops.fast_encode(x, crit[:1] + ([crit[1][0] * 0 + 3, crit[1][1]],) + crit[2:])
    with pytest.raises(ValueError, match="indices_s and locations_s"):
        ops.fast_encode(x, crit[:2] + (crit[2][:1],) + crit[3:])
    with pytest.raises(TypeError, match="integer"):
        ops.fast_encode(x, crit[:2] + ([t.double() for t in crit[2]],) + crit[3:])
    with pytest.raises(ValueError, match=r"locations_s\[1\]"):
        ops.fast_encode(x, crit[:2] + ([crit[2][0], crit[2][1][:3]],) + crit[3:])
    with pytest.raises(ValueError, match="capacity"):
        ops.fast_encode(x, crit[:4] + (-1, crit[5]))
