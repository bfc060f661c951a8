"""The graph of what every module of a package imports, read with ast (no
module is run): tests/unit/test_import_graph.py checks a2a's for cycles,
tests/unit/test_layering.py the layers of moe_runtime and a2a.

Every import counts, inside functions too (a lazy import is still a
dependency). ``from pkg import sub`` counts as importing pkg.sub when that is
a module; the implicit import of a parent package does not count."""

from __future__ import annotations

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files(package: str) -> dict[str, str]:
    """Dotted name -> path of every module under the package's folder (a
    package is its __init__.py)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def is_module(name: str, known: dict[str, str]) -> bool:
    """A module of the sources, or one of a package's modules without a source
    (the compiled a2a._C); a name inside a plain module is none."""
    if name in known:
        return True
    parent = name.rpartition(".")[0]
    if not known.get(parent, "").endswith("__init__.py"):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is no package
        return False


def imports_of(name: str, path: str, known: dict[str, str], packages: tuple[str, ...]) -> set[str]:
    """The modules of `packages` that the module `name` imports anywhere in its file."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    here = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if is_module(submodule, known) else source)
    return {module for module in found if any(inside(module, package) for package in packages) and module != name}


def inside(module: str, package: str) -> bool:
    """Whether `module` is `package` or one of its modules."""
    return module == package or module.startswith(package + ".")


def import_graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, for every module of `packages`."""
    modules = {name: path for package in packages for name, path in module_files(package).items()}
    return {name: imports_of(name, path, modules, packages) for name, path in modules.items()}


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
