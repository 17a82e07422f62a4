"""Lowering: one kernel launch per compute node of a (passed) graph.

The plan names, for each launch, the rendered kernel, how its grid grows with M and where each
argument comes from (a value, a weight buffer, or M itself), so an executor only binds memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qir.codegen.elementwise import elementwise_grid_x, elementwise_kernel
from qir.codegen.fragments import fragment_for
from qir.codegen.gemv import gemv_grid_x, gemv_kernel
from qir.codegen.kernel import Kernel
from qir.graph import Graph
from qir.ops import spec
from qir.types import QWeight, TensorType

# Rows of x one GEMV launch handles; grid.y covers the rest.
DEFAULT_M_TILE = 8


@dataclass(frozen=True)
class Arg:
    kind: Literal["value", "weight", "M"]
    ref: str = ""  # value name, or the weight node's name
    buffer: str = ""  # for weights: which of the format's buffers


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    grid_x: int
    m_tile: int  # grid.y = ceil(M / m_tile)
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]  # the values this launch writes
    nodes: tuple[str, ...]  # IR nodes it covers

    def grid(self, m: int) -> tuple[int, int, int]:
        return (self.grid_x, -(-m // self.m_tile), 1)


@dataclass(frozen=True)
class Plan:
    graph: Graph
    launches: tuple[Launch, ...]


def lower(graph: Graph, m_tile: int = DEFAULT_M_TILE) -> Plan:
    launches = []
    for name, node in graph.items():
        if node.op in ("input", "weight"):
            continue
        operands = graph.operands(name)
        out = node.type
        assert isinstance(out, TensorType)
        if node.op == "qlinear":
            x, wname = operands
            w = graph.node(wname).type
            assert isinstance(w, QWeight)
            frag = fragment_for(w.format, w.out_features, w.in_features)
            args = (
                Arg("value", x),
                *(Arg("weight", wname, b) for b in frag.buffers),
                Arg("value", name),
                Arg("M"),
            )
            kernel = gemv_kernel(w, out.dtype, m_tile)
            launches.append(Launch(kernel, gemv_grid_x(w), m_tile, args, (name,), (name,)))
        elif spec(node.op).elementwise:
            n = out.shape[1]
            assert isinstance(n, int)
            args = (*(Arg("value", o) for o in operands), Arg("value", name), Arg("M"))
            kernel = elementwise_kernel(node.op, out.dtype, n)
            launches.append(Launch(kernel, elementwise_grid_x(n), 1, args, (name,), (name,)))
        else:
            raise NotImplementedError(f"no kernel for %{name} = {node.op}")
    return Plan(graph, tuple(launches))
