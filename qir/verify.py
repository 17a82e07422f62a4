"""Verifier: every node re-checked against the op table."""

from __future__ import annotations

import networkx as nx

from qir.errors import QirError
from qir.graph import Graph
from qir.ops import VARIADIC, IRTypeError, cache_problem, input_problem, param_problem, spec
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
            problem = input_problem(node.type)
            if problem:
                raise VerifyError(f"%{name}: input {node.type} {problem}")
            continue
        if node.op == "weight":
            plain = not isinstance(node.type, QWeight) and param_problem(node.type) is None
            if not (isinstance(node.type, QWeight) or plain) or not node.attr("key"):
                raise VerifyError(
                    f"%{name}: weight needs a key and a qweight or 1-D parameter type"
                )
            continue
        if node.op == "state":
            _verify_state(graph, name)
            continue
        types = [graph.node(o).type for o in operands]
        try:
            inferred = s.infer(types, operands, dict(node.attrs))
        except IRTypeError as e:
            raise VerifyError(f"%{name}: {e}") from None
        if inferred != node.type:
            raise VerifyError(f"%{name} = {node.op}: declared {node.type}, inferred {inferred}")
        if node.op == "kv_append" and any(graph.node(o).op != "state" for o in operands[:2]):
            raise VerifyError(f"%{name}: kv_append writes state values only (its caches)")
    for name in graph.of_op("qlinear") + graph.of_op("kv_append"):
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


def _verify_state(graph: Graph, name: str) -> None:
    """A state (KV cache) is updated in place, so the only thing that may read it is the one
    kv_append that writes it: any other reader would see the old or the new rows depending on
    the order launches happen to run in."""
    node = graph.node(name)
    problem = cache_problem(node.type)
    if problem or not node.attr("key"):
        raise VerifyError(f"%{name}: state needs a key and a KV cache type ({problem or 'ok'})")
    users = [(u, graph.node(u).op) for u in graph.users(name)]
    uses = graph.use_count(name)
    appends = [u for u, op in users if op == "kv_append" and graph.operands(u).index(name) < 2]
    if len(appends) != 1 or uses != 1:
        raise VerifyError(
            f"%{name}: a state must be read by exactly one kv_append (as its cache), "
            f"found {uses} use(s)"
        )
