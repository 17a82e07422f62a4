"""Lowering: one kernel launch per compute node of a (passed) graph.

The plan names, for each launch, the rendered kernel, how its grid grows with M and where each
argument comes from (a value, a weight buffer, or M itself), so an executor only binds memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qir.codegen.elementwise import elementwise_grid_x, elementwise_kernel
from qir.codegen.fragments import fragment_for
from qir.codegen.gemv import GemvSpec, gemv_kernel
from qir.codegen.kernel import Kernel
from qir.graph import Graph
from qir.ops import qlinear_layout, spec
from qir.types import QWeight, TensorType, TupleType

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


def _lower_qlinear(graph: Graph, name: str, m_tile: int) -> Launch:
    node = graph.node(name)
    operands = graph.operands(name)
    ins, ws, extras = qlinear_layout(len(operands), dict(node.attrs))
    weights = tuple(t for w in operands[ws] if isinstance(t := graph.node(w).type, QWeight))
    if isinstance(node.type, TupleType):
        by_index = {graph.node(u).attr("index"): u for u in graph.users(name)}
        if sorted(by_index) != list(range(len(weights))):
            raise NotImplementedError(
                f"%{name}: every result of a multi-output qlinear needs a get"
            )
        outputs = tuple(by_index[i] for i in range(len(weights)))
        act = node.type.elements[0].dtype
    else:
        assert isinstance(node.type, TensorType)
        outputs, act = (name,), node.type.dtype
    gemv = GemvSpec(
        weights,
        act,
        m_tile,
        prologue=node.attr("prologue") == "silu_mul",
        epilogue=node.attr("epilogue") == "residual",
    )
    frag = fragment_for(weights[0].format, weights[0].out_features, weights[0].in_features)
    args = (
        *(Arg("value", v) for v in operands[ins]),
        *(Arg("weight", w, b) for w in operands[ws] for b in frag.buffers),
        *(Arg("value", o) for o in outputs),
        *(Arg("value", v) for v in operands[extras]),
        Arg("M"),
    )
    covers = (name, *node.attr("fused", ()))
    return Launch(gemv_kernel(gemv), gemv.grid_x, m_tile, args, outputs, covers)


def lower(graph: Graph, m_tile: int = DEFAULT_M_TILE) -> Plan:
    launches = []
    for name, node in graph.items():
        if node.op in ("input", "weight", "get"):
            continue  # leaves, and projections of a multi-output launch's results
        operands = graph.operands(name)
        if node.op == "qlinear":
            launches.append(_lower_qlinear(graph, name, m_tile))
        elif spec(node.op).elementwise:
            out = node.type
            assert isinstance(out, TensorType)
            n = out.shape[1]
            assert isinstance(n, int)
            args = (*(Arg("value", o) for o in operands), Arg("value", name), Arg("M"))
            kernel = elementwise_kernel(node.op, out.dtype, n)
            launches.append(Launch(kernel, elementwise_grid_x(n), 1, args, (name,), (name,)))
        else:
            raise NotImplementedError(f"no kernel for %{name} = {node.op}")
    return Plan(graph, tuple(launches))
