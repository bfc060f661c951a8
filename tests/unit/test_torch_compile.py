"""a2a under torch.compile (a2a/_dynamo.py): a call into a2a is a graph
break, and a2a runs as it does eagerly. Traced through before, a2a's Python
failed on the fake tensors of dynamic shapes (the second call of another
size raised TorchRuntimeError) and recompiled at every call. The layer
around it: tests/unit/test_runtime_compile.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

import a2a

torch = pytest.importorskip("torch")
dynamo = pytest.importorskip("torch._dynamo")
a2a_torch = pytest.importorskip("a2a.torch")


def test_a_compiled_function_calling_a2a_runs_it_eagerly_at_every_size(comm):
    w = torch.randn(2, 16, 16, requires_grad=True)

    def moe(x, indices, gates):
        routing = a2a.route(indices, 2, capacity=x.shape[0])
        rows = a2a_torch.fast_encode(x, routing)
        hidden = torch.bmm(rows, w)
        exchanged = a2a_torch.all_to_all(hidden.reshape(-1, 16), comm=comm).view_as(hidden)
        return a2a_torch.fast_decode(exchanged, routing, gates)

    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(moe, backend="aot_eager")
    graphs = []
    for tokens in (24, 17, 31, 24, 40, 9):  # other sizes: dynamo makes the shapes dynamic
        generator = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 16, generator=generator, requires_grad=True)
        indices = torch.randint(0, 2, (tokens, 1), generator=generator)
        gates = torch.rand(tokens, 1, generator=generator, requires_grad=True)
        got = compiled(x, indices, gates)
        got.square().sum().backward()
        got_grads = (x.grad.clone(), gates.grad.clone(), w.grad.clone())
        for tensor in (x, gates, w):
            tensor.grad = None
        want = moe(x, indices, gates)
        want.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, e in zip(got_grads, (x.grad, gates.grad, w.grad), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        for tensor in (x, gates, w):
            tensor.grad = None
        graphs.append(dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[-1], graphs  # once the shapes are dynamic, a new size compiles nothing
    assert graphs[-1] <= 6, graphs  # the pieces between the calls into a2a, static then dynamic
    dynamo.reset()


ORDER = """
import sys
import torch
{before}
import a2a
from a2a import _dynamo
{after}
print(_dynamo._registered, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("before, after, registered", [
    ("", "", False),  # a2a does not load dynamo itself (a second of import)
    ("", "import a2a.torch", False),  # nor does a2a.torch
    ("torch.compile(lambda x: x)", "", True),  # dynamo loaded first: a2a registers at its import
    ("", "torch.compile(lambda x: x)", True),  # loaded after: a2a registers once its module has run
], ids=["a2a", "a2a.torch", "compile-first", "compile-after"])
def test_a2a_registers_with_dynamo_whenever_it_loads_and_never_loads_it(before, after, registered):
    result = subprocess.run([sys.executable, "-c", ORDER.format(before=before, after=after)], capture_output=True,
                            text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(registered), str(registered)], result.stdout
