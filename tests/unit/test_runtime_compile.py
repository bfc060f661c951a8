"""A model holding the layer under torch.compile: the layer runs as it does
eagerly, behind one graph break (moe_runtime/common/graphs.py,
call_in_graphs), and the modules around it compile once. Traced through
before, the layer recompiled at every call until dynamo's limit (38 graphs
for 12 steps; the compiled step took 1.9x the eager one), and the dropless
flow failed on the fake tensors of dynamic shapes."""

from __future__ import annotations

import pytest

import moe_runtime

torch = pytest.importorskip("torch")
dynamo = pytest.importorskip("torch._dynamo")


class Model(torch.nn.Module):
    def __init__(self, comm, **options):
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.moe = moe_runtime.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0}, 16,
                                        {"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32},
                                        comm=comm, seeds=(1, 2), **options)
        self.post = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.moe(torch.relu(self.pre(x)))
        return self.post(y), y.l_aux


def step(model, x):
    y, l_aux = model(x)
    (y.square().sum() + l_aux).backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [{}, {"flow": "dropless"}, {"a2a_ffn_overlap_degree": 2}],
                         ids=["expert", "dropless", "d2"])
def test_the_layer_is_one_graph_break_and_computes_what_it_computes_eagerly(comm, options):
    torch.manual_seed(0)
    eager, compiled = Model(comm, **options), Model(comm, **options)
    compiled.load_state_dict(eager.state_dict())
    dynamo.reset()
    dynamo.utils.counters.clear()
    run = torch.compile(compiled, backend="aot_eager")
    for seed in range(4):  # one shape: nothing to recompile
        x = torch.randn(24, 16, generator=torch.Generator().manual_seed(seed))
        for module in (eager, compiled):
            module.zero_grad(set_to_none=True)
        want_y, want_grads = step(eager, x)
        got_y, got_grads = step(run, x)
        torch.testing.assert_close(got_y, want_y, rtol=1e-6, atol=1e-6)
        for got, want in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    stats = dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] <= 2, dict(stats)  # the modules before the layer, and after it
    breaks = {reason.splitlines()[0] for reason in dynamo.utils.counters["graph_break"]}
    assert breaks == {"Skip calling `torch.compiler.disable()`d function"}, breaks
    dynamo.reset()


def test_the_compile_cost_tool_reports_two_graphs_for_the_compiled_model():
    """tools/compile_cost.py, which docs/benchmarks.md quotes, on dynamo's eager backend."""
    import os
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "compile_cost.py")
    done = subprocess.run([sys.executable, tool, "--backend", "eager", "--warmup", "3", "--steps", "2"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = [line.split() for line in done.stdout.splitlines() if line.startswith("compiled")]
    assert len(compiled) == 1 and compiled[0][2] == "2", done.stdout  # "compiled (eager)", graphs, ...
