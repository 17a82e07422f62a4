"""What every pass is: a named object whose run() rewrites a graph in place and returns how
many times it fired."""

from __future__ import annotations

from typing import Protocol

from qir.graph import Graph


class Pass(Protocol):
    @property
    def name(self) -> str: ...

    def run(self, graph: Graph) -> int: ...
