"""No import cycles in a2a/: the graph of what every module imports, read
with ast (tests/import_graph.py), counts imports inside functions too (a
lazy import is still a dependency) and must have no cycle."""

from __future__ import annotations

import pytest
from import_graph import find_cycle, import_graph


def test_no_import_cycles_in_a2a():
    cycle = find_cycle(import_graph("a2a"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph("a2a")
    assert "a2a.torch" in graph["a2a._moe"]  # inside a function: the autograd hand-over
    assert "a2a._torch_collectives" in graph["a2a._collective_api"]  # the same for the collectives
    assert "a2a._routing" in graph["a2a"]  # from ._routing import ...
    assert "a2a.launch" in graph["a2a.bench.collectives"]  # from .. import launch
    assert "a2a.bench.common" in graph["a2a.bench.kernels"]  # from . import common
    assert {"a2a.bench.collectives", "a2a.bench.kernels", "a2a.bench.layout"} <= graph["a2a.bench.__main__"]
    assert "a2a._C" in graph["a2a._arrays"]  # from . import _C: the compiled module, not the package
    assert "a2a" not in graph["a2a._arrays"]
    assert not any(m == "torch" for g in graph.values() for m in g)  # only a2a's modules


@pytest.mark.parametrize(
    "graph, expect",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
)
def test_find_cycle(graph, expect):
    assert find_cycle(graph) == expect
