"""The Python entry points: compile a graph for a backend and run it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from qir.codegen.lower import DEFAULT_M_TILE, Plan, lower
from qir.errors import UsageError
from qir.graph import Graph
from qir.interpret import Weights, interpret
from qir.passes.manager import PassRecord, run_pipeline
from qir.runtime.backend import BACKENDS, get_backend
from qir.runtime.executor import CompiledBlock


@dataclass
class Compiled:
    """A block ready to run: the graph after passes, its launch plan (kernel backends), and
    the pass records."""

    source: Graph
    graph: Graph
    backend: str
    weights: Weights
    records: list[PassRecord] = field(default_factory=list)
    plan: Plan | None = None
    _exec: CompiledBlock | None = None

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._exec is None:
            return interpret(self.graph, inputs, self.weights)
        return self._exec.run(inputs)

    @property
    def kernel_count(self) -> int:
        return len(self.plan.launches) if self.plan else 0


def compile(
    graph: Graph,
    weights: Weights,
    backend: str = "host",
    passes: str | Sequence[str] = "default",
    m_tile: int = DEFAULT_M_TILE,
) -> Compiled:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    passed, records = run_pipeline(graph, passes)
    c = Compiled(graph, passed, backend, weights, records)
    if backend != "reference":
        c.plan = lower(passed, m_tile)
        c._exec = CompiledBlock(c.plan, get_backend(backend), weights)
    return c
