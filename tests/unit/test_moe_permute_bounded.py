"""a2a.permute(..., wait=False): the dropless permutation that reads nothing
back, T * k rows (a bound). For every case of test_moe_route.py: where every
choice is routed, the same tables and rows as permute, bit for bit; where
some are not, the routed rows the same, the rest the last expert's, zero,
and unpermute (gated or not) the same; autograd through a2a.torch the same;
no host wait until num_dropped is read; a bad index not routed meanwhile and
raised where num_dropped is read; a pickled routing the same."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import reference as ref
from checks import counting_alone
from test_moe_route import CASES, case_indices

import a2a


def tokens(num_tokens, model_dim=7, seed=3):
    return np.random.default_rng(seed).standard_normal((num_tokens, model_dim)).astype(np.float32)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_the_routed_rows_and_tables_are_permutes(name, dtype):
    indices, num_experts, _ = case_indices(name, dtype)
    num_tokens, top_k = indices.shape
    x = tokens(num_tokens)
    rows, perm = a2a.permute(x, indices, num_experts)
    garbage = np.full((num_tokens * top_k, x.shape[1]), np.nan, dtype=x.dtype)  # the padding must be written
    bounded_rows, bounded = a2a.permute(x, indices, num_experts, wait=False, out=garbage)
    routed = perm.num_rows
    assert bounded.dropless and bounded.host_counts is None and bounded.num_rows == num_tokens * top_k
    for table in ("locations", "counts", "row_map"):
        assert np.array_equal(getattr(bounded, table), getattr(perm, table)), (name, table)
    assert np.array_equal(bounded.offsets[:-1], perm.offsets[:-1]) and bounded.offsets[-1] == num_tokens * top_k
    assert np.array_equal(bounded_rows[:routed], rows), name
    assert not bounded_rows[routed:].any(), f"{name}: the rows past the routed ones are not zero"
    gates = np.random.default_rng(5).random((num_tokens, top_k)).astype(np.float32)
    for g in (None, gates):
        assert np.array_equal(a2a.unpermute(bounded_rows, bounded, g), a2a.unpermute(rows, perm, g)), name
    assert bounded.num_dropped == 0


def test_every_choice_routed_is_permutes_layout_itself():
    indices, num_experts, _ = case_indices("many-tokens")
    indices = np.abs(indices) % num_experts  # a top-k's: every choice routed
    x = tokens(len(indices))
    rows, perm = a2a.permute(x, indices, num_experts)
    bounded_rows, bounded = a2a.permute(x, indices, num_experts, wait=False)
    assert perm.num_rows == bounded.num_rows and np.array_equal(bounded.offsets, perm.offsets)
    assert np.array_equal(bounded_rows, rows)


@pytest.mark.parametrize("name", ["top4-unrouted", "top2-skewed-drops"])
def test_autograd_is_permutes(name):
    torch = pytest.importorskip("torch")
    import a2a.torch as a2a_torch

    indices, num_experts, _ = case_indices(name)
    num_tokens, top_k = indices.shape
    gates = torch.rand(num_tokens, top_k, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = []
    for wait in (True, False):
        x = torch.from_numpy(tokens(num_tokens)).double().requires_grad_()
        g = gates.clone().requires_grad_()
        rows, perm = a2a_torch.permute(x, torch.from_numpy(indices), num_experts, wait=wait)
        weights = torch.linspace(-1, 1, rows.shape[1], dtype=rows.dtype)
        y = a2a_torch.unpermute(rows * weights, perm, g)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, g.grad))
    for waited, bounded in zip(*results, strict=True):
        assert torch.equal(waited, bounded), name


def test_no_host_wait_until_num_dropped_is_read():
    indices, num_experts, _ = case_indices("top4-unrouted")
    with counting_alone() as permuted:
        rows, perm = a2a.permute(tokens(len(indices)), indices, num_experts, wait=False)
        a2a.unpermute(rows, perm)
    assert (permuted.counters.host_waits, permuted.counters.kernel_calls) == (0, 3), permuted.counters
    assert "num_dropped=on the device" in repr(perm)
    with counting_alone() as read:
        assert perm.num_dropped == 0
    assert read.counters.host_waits == 1


def test_a_bad_index_is_not_routed_and_raises_where_num_dropped_is_read():
    indices, num_experts, _ = case_indices("top2-skewed-drops")
    bad = indices.copy()
    bad[3, 1] = num_experts + 2
    _, perm = a2a.permute(tokens(len(bad)), bad, num_experts, wait=False)
    assert perm.row_map[3, 1] == -1 and perm.counts.sum() == (bad >= 0).sum() - 1
    with pytest.raises(a2a.InvalidArgumentError, match=r"indices\[3, 1\]"):
        _ = perm.num_dropped


def test_a_pickled_routing_is_the_same():
    indices, num_experts, _ = case_indices("top4-unrouted")
    x = tokens(len(indices))
    rows, perm = a2a.permute(x, indices, num_experts, wait=False)
    copy = pickle.loads(pickle.dumps(perm))
    assert copy.num_rows == perm.num_rows and copy.num_dropped == 0
    assert np.array_equal(a2a.unpermute(rows, copy), a2a.unpermute(rows, perm))
    assert np.array_equal(ref.as_numpy(a2a.permute(x, indices, num_experts, wait=False)[0]), rows)


def test_wait_must_be_a_bool():
    indices, num_experts, _ = case_indices("top4-unrouted")
    with pytest.raises(TypeError, match="wait"):
        a2a.permute(tokens(len(indices)), indices, num_experts, wait=0)
