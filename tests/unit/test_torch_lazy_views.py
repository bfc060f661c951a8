"""torch tensors whose negative bit is set (lazy views: their memory holds
the values before the negation) are refused by every call that reads or
writes memory, naming the argument, on the fast paths as on the general
ones: read as stored, they would give the negated values silently."""

from __future__ import annotations

import pytest
from checks import raises_invalid

import a2a

torch = pytest.importorskip("torch")


def negated(t):
    return t._neg_view()


def test_the_collectives_refuse_them(comm):
    x = torch.arange(4.0)
    assert negated(x).is_neg() and negated(x).is_contiguous()
    raises_invalid(lambda: a2a.all_to_all(negated(x), comm=comm), "all_to_all", "negative bit", "resolve_neg()")
    raises_invalid(lambda: a2a.all_reduce(negated(x), comm=comm), "all_reduce", "negative bit")
    raises_invalid(lambda: a2a.all_to_all(x, comm=comm, out=negated(torch.empty(4))), "all_to_all", "negative bit")
    # From a complex tensor, as a user meets it.
    imag = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag
    raises_invalid(lambda: a2a.all_to_all(imag, comm=comm), "negative bit")
    assert torch.equal(a2a.all_to_all(imag.resolve_neg(), comm=comm), torch.tensor([-2.0]))


def test_the_moe_kernels_refuse_them():
    x, gates = torch.randn(4, 8), torch.rand(4, 1)
    routing = a2a.route(torch.tensor([[0], [1], [0], [1]]), 2, capacity=2)
    raises_invalid(lambda: a2a.fast_encode(negated(x), routing), "fast_encode", "negative bit")
    raises_invalid(lambda: a2a.fast_encode(x, routing, negated(gates)), "fast_encode", "negative bit")
    raises_invalid(lambda: a2a.fast_encode(x, routing, out=negated(torch.empty(2, 2, 8))), "fast_encode",
                   "negative bit")
    rows = a2a.fast_encode(x, routing)
    raises_invalid(lambda: a2a.fast_decode(negated(rows), routing), "fast_decode", "negative bit")
    raises_invalid(lambda: a2a.quantize_fp8(negated(x)), "quantize_fp8", "negative bit")
    assert torch.equal(a2a.fast_decode(a2a.fast_encode(negated(x).resolve_neg(), routing), routing), -x)


def test_the_expert_operators_refuse_them():
    index = a2a.es_index(torch.tensor([[0], [1], [0], [1]]), 2)
    x, w = torch.randn(4, 8), torch.randn(2, 3, 8)
    raises_invalid(lambda: a2a.esmm(negated(x), w, index), "esmm", "x is a torch tensor whose negative bit")
    raises_invalid(lambda: a2a.esmm(x, negated(w), index), "esmm", "w is a torch tensor whose negative bit")
