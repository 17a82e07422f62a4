"""qir: a compiler for quantized LLM inference blocks.

The names below are imported on first use (PEP 562), so `import qir` and `qir --help` start
without numpy, the compiler or the serving stack (tests/test_startup.py).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from qir import logs

if TYPE_CHECKING:
    from qir.api import Compiled, compile
    from qir.builder import Builder, Value
    from qir.graph import Graph
    from qir.interpret import interpret
    from qir.parser import parse
    from qir.printer import print_graph

# each public name: the module that defines it
_LAZY = {
    "Builder": "qir.builder",
    "Compiled": "qir.api",
    "Graph": "qir.graph",
    "Value": "qir.builder",
    "compile": "qir.api",
    "interpret": "qir.interpret",
    "parse": "qir.parser",
    "print_graph": "qir.printer",
}

logs.setup()

__all__ = ["Builder", "Compiled", "Graph", "Value", "compile", "interpret", "parse", "print_graph"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qir' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


class _Package(types.ModuleType):
    """qir.interpret is both a function and a submodule: importing the submodule sets the
    package's attribute to the module, which would hide the function from `from qir import
    interpret` once anything imported qir.interpret first. The function keeps the name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
