"""The layers of moe_runtime and a2a, read from the import graph (ast, lazy
imports included: tests/import_graph.py).

moe_runtime: the base (common, gating, experts, flows, tuning) at the
bottom; one package per paper system above it (deployment, dynamic, flex,
hexa), each on the base alone; the top-level modules (the package itself,
the layer, the reference) over both; Tutel's surface (moe_runtime.moe) over them;
the benchmarks (moe_runtime.bench)
apart, imported by nothing of the library. No import cycle anywhere.
a2a: the benchmarks draw the scale model's predictions, so a2a.bench and
a2a.sim never import each other both ways. And no module of either package
over 600 lines, so that each reads in one sitting.
"""

from __future__ import annotations

import os

import pytest
from import_graph import ROOT, find_cycle, import_graph, inside, module_files

BASE = ("moe_runtime.common", "moe_runtime.gating", "moe_runtime.experts", "moe_runtime.flows",
        "moe_runtime.tuning")
SYSTEMS = ("moe_runtime.deployment", "moe_runtime.dynamic", "moe_runtime.flex", "moe_runtime.hexa")
BENCH = "moe_runtime.bench"
# Other libraries' surfaces over the layer (moe_runtime.moe: Tutel's), imported by nothing of the library.
INTERFACES = ("moe_runtime.moe",)
MAX_LINES = 600
THIN_LAYER_LINES = 400  # MoELayer is gate -> agree -> flow -> output; the flows hold the rest


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph("a2a", "moe_runtime")


def layer_of(module: str) -> str:
    """base, system, bench, interface or top (a module of moe_runtime outside the packages
    above: the package itself, layer.py, reference.py); other for a2a's."""
    if not inside(module, "moe_runtime"):
        return "other"
    if any(inside(module, package) for package in BASE):
        return "base"
    if any(inside(module, package) for package in SYSTEMS):
        return "system"
    if inside(module, BENCH):
        return "bench"
    if any(inside(module, package) for package in INTERFACES):
        return "interface"
    return "top"


def imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importing module, imported module), sorted."""
    return sorted((module, target) for module, targets in graph.items() for target in targets)


def listed(pairs: list[tuple[str, str]]) -> str:
    return "; ".join(f"{module} imports {target}" for module, target in pairs)


def test_no_import_cycle_in_moe_runtime(graph):
    runtime = {module: {t for t in targets if inside(t, "moe_runtime")}
               for module, targets in graph.items() if inside(module, "moe_runtime")}
    cycle = find_cycle(runtime)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_package_of_moe_runtime_has_a_layer():
    """A new package is placed in BASE or SYSTEMS (or is the benchmarks'),
    else the checks below would not see it."""
    packages = {name for name, path in module_files("moe_runtime").items()
                if path.endswith("__init__.py") and name.count(".") == 1}
    placed = {*BASE, *SYSTEMS, BENCH, *INTERFACES}
    assert packages <= placed, f"packages in no layer (add them to BASE or SYSTEMS): {sorted(packages - placed)}"
    assert placed <= packages, f"layers name packages that are gone: {sorted(placed - packages)}"


@pytest.mark.parametrize("package", BASE)
def test_the_base_imports_no_system_no_benchmark_and_no_top_module(graph, package):
    wrong = [(module, target) for module, target in imports(graph)
             if inside(module, package) and layer_of(target) in ("system", "bench", "top", "interface")]
    assert not wrong, f"the base ({package}) imports above itself: {listed(wrong)}"


@pytest.mark.parametrize("package", SYSTEMS)
def test_a_system_imports_only_the_base_and_itself(graph, package):
    wrong = [(module, target) for module, target in imports(graph)
             if inside(module, package) and inside(target, "moe_runtime")
             and not (inside(target, package) or layer_of(target) == "base")]
    assert not wrong, f"the system {package} imports beside the base and itself: {listed(wrong)}"


def test_no_library_module_imports_the_benchmarks(graph):
    wrong = [(module, target) for module, target in imports(graph)
             if inside(target, BENCH) and not inside(module, BENCH)]
    assert not wrong, f"the library imports the benchmarks: {listed(wrong)}"


def test_no_library_module_imports_another_librarys_surface(graph):
    wrong = [(module, target) for module, target in imports(graph)
             if layer_of(target) == "interface" and layer_of(module) not in ("interface", "bench")]
    assert not wrong, f"the library imports an interface package: {listed(wrong)}"


def test_a2a_bench_and_a2a_sim_do_not_import_each_other(graph):
    there = [(m, t) for m, t in imports(graph) if inside(m, "a2a.bench") and inside(t, "a2a.sim")]
    back = [(m, t) for m, t in imports(graph) if inside(m, "a2a.sim") and inside(t, "a2a.bench")]
    assert not (there and back), f"a2a.bench and a2a.sim import each other: {listed(there)}; {listed(back)}"


def line_counts() -> dict[str, int]:
    """Lines of every module of a2a/ and moe_runtime/, by path from the repository root."""
    counts = {}
    for package in ("a2a", "moe_runtime"):
        for path in module_files(package).values():
            with open(path, encoding="utf-8") as fh:
                counts[os.path.relpath(path, ROOT)] = sum(1 for _ in fh)
    return counts


def test_no_module_over_600_lines():
    long = {path: lines for path, lines in line_counts().items() if lines > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_layer_is_thin():
    lines = line_counts()["moe_runtime/layer.py"]
    assert lines < THIN_LAYER_LINES, f"moe_runtime/layer.py: {lines} lines"
