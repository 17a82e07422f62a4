"""Verifier: every node checked against the op table, in one pass over the program order.

The pass manager verifies after every pass, and a pass changes a few nodes of a model: a node
is checked again only when the graph says its definition, its operands or an operand's type
changed since verify last passed on it (Graph.unverified); the graph-wide checks (acyclic,
one get per result, outputs defined) run every time. Linear in the graph either way."""

from __future__ import annotations

from qir.errors import QirError
from qir.graph import CycleError, Graph, Node
from qir.ops import VARIADIC, IRTypeError, Op, cache_problem, input_problem, param_problem, spec
from qir.types import QExperts, QWeight, ValueType


class VerifyError(QirError, ValueError):
    pass


def verify(graph: Graph) -> None:
    try:
        order = graph.order()
    except CycleError:
        raise VerifyError(f"graph {graph.name} has a cycle") from None
    todo = graph.unverified()
    multi, states = [], []
    for name in order:
        node = graph.node(name)
        if node.op in (Op.QLINEAR, Op.KV_APPEND):
            multi.append(name)
        elif node.op == Op.STATE:
            states.append(name)
        if todo is not None and name not in todo:
            continue
        operands = graph.operands(name)
        types = tuple(graph.node(o).type for o in operands)
        _check(name, node, operands, types)
        _check_state_reads(graph, name, node, operands)
    # A state (KV cache) is updated in place, so the one thing that may read it is the one
    # kv_append that writes it: any other reader would see the old or the new rows depending on
    # the order launches happen to run in.
    for name in states:
        if graph.use_count(name) != 1:
            raise VerifyError(
                f"%{name}: a state must be read by exactly one kv_append (as its cache), "
                f"found {graph.use_count(name)} use(s)"
            )
    for name in multi:
        indices = [
            graph.node(u).attr("index") for u in graph.users(name) if graph.node(u).op == Op.GET
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
    if node.op == Op.INPUT:
        problem = input_problem(node.type)
        if problem:
            raise VerifyError(f"%{name}: input {node.type} {problem}")
        return
    if node.op == Op.WEIGHT:
        quantized = isinstance(node.type, (QWeight, QExperts))
        plain = not quantized and param_problem(node.type) is None
        if not (quantized or plain) or not node.attr("key"):
            raise VerifyError(
                f"%{name}: weight needs a key and a qweight, experts or 1-D parameter type"
            )
        return
    if node.op == Op.STATE:
        problem = cache_problem(node.type)
        if problem or not node.attr("key"):
            raise VerifyError(f"%{name}: state needs a key and a KV cache type ({problem})")
        return
    try:
        inferred = s.infer(list(types), operands, dict(node.attrs))
    except IRTypeError as e:
        raise VerifyError(f"%{name}: {e}") from None
    if inferred != node.type:
        raise VerifyError(f"%{name} = {node.op}: declared {node.type}, inferred {inferred}")


def _check_state_reads(graph: Graph, name: str, node: Node, operands: tuple[str, ...]) -> None:
    """States are read only as a kv_append's caches (operands 0 and 1), which are states."""
    for i, o in enumerate(operands):
        if graph.node(o).op == Op.STATE and (node.op != Op.KV_APPEND or i > 1):
            raise VerifyError(
                f"%{name} = {node.op}: reads state %{o}; a state must be read by exactly one "
                "kv_append (as its cache)"
            )
    if node.op == Op.KV_APPEND and any(graph.node(o).op != Op.STATE for o in operands[:2]):
        raise VerifyError(f"%{name}: kv_append writes state values only (its caches)")
