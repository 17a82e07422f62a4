"""Verifier: every node re-checked against the op table."""

from __future__ import annotations

import networkx as nx

from qir.errors import QirError
from qir.graph import Graph
from qir.ops import VARIADIC, IRTypeError, activation_problem, spec
from qir.types import QWeight


class VerifyError(QirError, ValueError):
    pass


def verify(graph: Graph) -> None:
    if not nx.is_directed_acyclic_graph(graph.g):
        raise VerifyError(f"graph {graph.name} has a cycle")
    for name, node in graph.items():
        try:
            s = spec(node.op)
        except IRTypeError as e:
            raise VerifyError(f"%{name}: {e}") from None
        operands = graph.operands(name)
        if s.arity != VARIADIC and len(operands) != s.arity:
            raise VerifyError(f"%{name} = {node.op}: {len(operands)} operands, expected {s.arity}")
        unknown = {k for k, _ in node.attrs} - s.attrs
        if unknown:
            raise VerifyError(f"%{name} = {node.op}: unknown attributes {sorted(unknown)}")
        if node.op == "input":
            problem = activation_problem(node.type)
            if problem:
                raise VerifyError(f"%{name}: input {node.type} {problem}")
            continue
        if node.op == "weight":
            if not isinstance(node.type, QWeight) or not node.attr("key"):
                raise VerifyError(f"%{name}: weight needs a qweight type and a key")
            continue
        types = [graph.node(o).type for o in operands]
        try:
            inferred = s.infer(types, operands, dict(node.attrs))
        except IRTypeError as e:
            raise VerifyError(f"%{name}: {e}") from None
        if inferred != node.type:
            raise VerifyError(f"%{name} = {node.op}: declared {node.type}, inferred {inferred}")
    for name in graph.of_op("qlinear"):
        indices = [
            graph.node(u).attr("index") for u in graph.users(name) if graph.node(u).op == "get"
        ]
        if len(indices) != len(set(indices)):
            raise VerifyError(f"%{name}: two gets of the same result")
    if not graph.outputs:
        raise VerifyError(f"graph {graph.name} has no outputs")
    for out, value in graph.outputs:
        if value not in graph:
            raise VerifyError(f"output {out} refers to undefined %{value}")
