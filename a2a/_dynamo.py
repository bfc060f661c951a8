"""a2a under torch.compile: a call into a2a is a graph break, and a2a runs
as it does eagerly.

a2a's collectives and kernels are native calls on the tensors' memory, no
torch ops that dynamo could put in a graph; traced through, a2a's Python
failed on the fake tensors of dynamic shapes, and recompiled at every call
until dynamo's limit. So a2a asks dynamo not to trace its files, once
dynamo is loaded: at a2a's import where it is loaded already, else right
after its import (torch.compile loads it), through a one-time import hook.
a2a never loads dynamo itself: that alone takes a second."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["register_with_dynamo"]

_DYNAMO = "torch._dynamo"
_registered = False


def _register() -> bool:
    """Tells the loaded dynamo not to trace a2a's files, once; whether a2a is registered."""
    global _registered
    if not _registered and _DYNAMO in sys.modules:
        try:
            from torch._dynamo.trace_rules import add
        except (ImportError, AttributeError):  # a dynamo without this rule traces a2a, as before
            return False
        add(__package__)  # the package's directory: every a2a module, a2a.torch included
        _registered = True
    return _registered


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo through the other finders and registers a2a once its module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)  # once, and the search below does not come back here
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                _register()

            spec.loader.exec_module = exec_module
        return spec


def register_with_dynamo() -> None:
    """At a2a's import: registers now where dynamo is loaded, else when it is."""
    if not _register() and not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())
