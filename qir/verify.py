"""Verifier: every node checked against the op table, in one pass over the program order.

The pass manager verifies after every pass, and a pass changes a few nodes of a model: a node
is checked again only when the graph says its definition, its operands or an operand's type
changed since verify last passed on it (Graph.unverified); the graph-wide checks (acyclic,
one get per result, outputs defined) run every time. Linear in the graph either way."""

from __future__ import annotations

from qir.errors import QirError
from qir.graph import CycleError, Graph, Node
from qir.ops import VARIADIC, IRTypeError, activation_problem, spec
from qir.types import QWeight, ValueType


class VerifyError(QirError, ValueError):
    pass


def verify(graph: Graph) -> None:
    try:
        order = graph.order()
    except CycleError:
        raise VerifyError(f"graph {graph.name} has a cycle") from None
    todo = graph.unverified()
    qlinears = []
    for name in order:
        node = graph.node(name)
        if node.op == "qlinear":
            qlinears.append(name)
        if todo is not None and name not in todo:
            continue
        operands = graph.operands(name)
        types = tuple(graph.node(o).type for o in operands)
        _check(name, node, operands, types)
    for name in qlinears:
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
    graph.verified()


def _check(name: str, node: Node, operands: tuple[str, ...], types: tuple[ValueType, ...]) -> None:
    try:
        s = spec(node.op)
    except IRTypeError as e:
        raise VerifyError(f"%{name}: {e}") from None
    if s.arity != VARIADIC and len(operands) != s.arity:
        raise VerifyError(f"%{name} = {node.op}: {len(operands)} operands, expected {s.arity}")
    unknown = {k for k, _ in node.attrs} - s.attrs
    if unknown:
        raise VerifyError(f"%{name} = {node.op}: unknown attributes {sorted(unknown)}")
    if node.op == "input":
        problem = activation_problem(node.type)
        if problem:
            raise VerifyError(f"%{name}: input {node.type} {problem}")
        return
    if node.op == "weight":
        if not isinstance(node.type, QWeight) or not node.attr("key"):
            raise VerifyError(f"%{name}: weight needs a qweight type and a key")
        return
    try:
        inferred = s.infer(list(types), operands, dict(node.attrs))
    except IRTypeError as e:
        raise VerifyError(f"%{name}: {e}") from None
    if inferred != node.type:
        raise VerifyError(f"%{name} = {node.op}: declared {node.type}, inferred {inferred}")
