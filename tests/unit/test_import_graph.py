"""No import cycles in a2a/: the graph of what every module imports, read
with ast, counts imports inside functions too (a lazy import is still a
dependency) and must have no cycle."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "a2a")


def module_files() -> dict[str, str]:
    """Dotted name -> path of every module under a2a/ (a package is its __init__.py)."""
    modules = {}
    root = os.path.dirname(PACKAGE_DIR)
    for folder, _, files in os.walk(PACKAGE_DIR):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def is_module(name: str, known: set[str]) -> bool:
    """A module of a2a's sources, or one without a source (the compiled a2a._C)."""
    if name in known:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is no package
        return False


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of a2a that `name` imports anywhere in its file.
    `from pkg import sub` counts as importing pkg.sub when that is a module;
    the implicit import of a parent package does not count."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if source.startswith("a2a") and is_module(submodule, known) else source)
    return {module for module in found if (module == "a2a" or module.startswith("a2a.")) and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return visiting[visiting.index(node) :] + [node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_no_import_cycles_in_a2a():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
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
