"""out= of a torch tensor that requires grad, in grad mode, is refused by
every call that writes it in place (as torch refuses out= of such a
tensor): autograd cannot record a2a's write, and the tensor's gradient
would come out of a graph that no longer computes its values. Under
torch.no_grad() it is written, as torch writes it."""

from __future__ import annotations

import pytest
from checks import raises_invalid

import a2a

torch = pytest.importorskip("torch")


def leaf(*shape):
    return torch.zeros(*shape, requires_grad=True)


def test_every_call_that_writes_out_refuses_a_tensor_that_requires_grad(comm):
    x = torch.randn(4, 8)
    index = a2a.es_index(torch.tensor([[0], [1], [0], [1]]), 2)
    routing = a2a.route(torch.tensor([[0], [1], [0], [1]]), 2, capacity=2)
    calls = {
        "all_to_all": lambda out: a2a.all_to_all(x, comm=comm, out=out),
        "all_to_all_flex": lambda out: a2a.all_to_all_flex(x, comm=comm, split_axis=0, concat_axis=1, out=out),
        "all_to_all_v": lambda out: a2a.all_to_all_v(x, [4], comm=comm, out=out),
        "all_reduce": lambda out: a2a.all_reduce(x, comm=comm, out=out),
        "dequantize_fp8": lambda out: a2a.dequantize_fp8(*a2a.quantize_fp8(x), out=out),
        "fast_encode": lambda out: a2a.fast_encode(x, routing, out=out.view(2, 2, 8)),
    }
    for op, call in calls.items():
        raises_invalid(lambda call=call: call(leaf(4, 8)), op, "out", "require")
    raises_invalid(lambda: a2a.esmm(torch.randn(4, 8), torch.randn(2, 3, 8), index, out=leaf(4, 3)), "esmm",
                   "out requires grad")
    with torch.no_grad():
        out = leaf(4, 8)
        assert a2a.all_to_all(x, comm=comm, out=out) is out and torch.equal(out, x)
        out = leaf(2, 2, 8)  # the MoE kernels write it too, as the collectives do
        rows = a2a.fast_encode(x, routing, out=out)
        assert rows.data_ptr() == out.data_ptr() and torch.equal(out, torch.stack([x[[0, 2]], x[[1, 3]]]))
