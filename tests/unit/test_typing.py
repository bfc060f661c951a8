"""The package is typed: a2a/py.typed, and a2a/_C.pyi naming exactly what
the compiled module exports (so that the stub cannot drift from module.cpp)."""

from __future__ import annotations

import ast
import os

import pytest

from a2a import _C

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "a2a")
STUB = os.path.join(PACKAGE_DIR, "_C.pyi")


def public(names):
    return {name for name in names if not name.startswith("_")}


def stub_tree() -> ast.Module:
    with open(STUB, encoding="utf-8") as fh:
        return ast.parse(fh.read(), STUB)


def defined(body) -> set[str]:
    """Functions, classes and annotated constants (``UNDEFINED: int``) defined
    in a stub body (type aliases are the stub's own)."""
    names = {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return names | {node.target.id for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def test_py_typed_marks_the_package():
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed"))


def test_stub_names_what_the_module_exports():
    in_stub, in_module = public(defined(stub_tree().body)), public(dir(_C))
    assert in_stub == in_module, f"only in the stub: {in_stub - in_module}; only in _C: {in_module - in_stub}"


@pytest.mark.parametrize("cls", ["Comm", "VPlan"])
def test_stub_classes_name_every_member(cls):
    [node] = [n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == cls]
    in_stub, in_module = public(defined(node.body)), public(dir(getattr(_C, cls)))
    assert in_stub == in_module, f"{cls}: only in the stub: {in_stub - in_module}; only in _C: {in_module - in_stub}"


def stub_functions():
    """(native object, stub def) of every function and method the stub spells out."""
    for node in stub_tree().body:
        if isinstance(node, ast.FunctionDef):
            yield getattr(_C, node.name), node
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and member.name in vars(getattr(_C, node.name)):
                    yield getattr(getattr(_C, node.name), member.name), member


def test_stub_parameters_match_the_named_arguments():
    """Where module.cpp names the arguments (py::arg), the stub uses the same
    names; where it does not (arg0, arg1, ...), the stub makes them positional-only."""
    checked = 0
    for native, node in stub_functions():
        if isinstance(native, property):
            continue
        signature = native.__doc__.splitlines()[0]
        named = [arg.arg for arg in node.args.args if arg.arg != "self"]
        if "arg0" in signature:
            assert not named, f"{node.name}: {named} must be positional-only (before /): {signature}"
            continue
        for name in named:
            assert f"{name}:" in signature, f"{node.name}: the stub's {name!r} is not in {signature!r}"
            checked += 1
    assert checked > 20
