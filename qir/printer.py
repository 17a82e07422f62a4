"""Deterministic IR text. `parser.parse(print_graph(g))` rebuilds the same graph."""

from __future__ import annotations

import json

from qir.graph import AttrValue, Graph


def format_attr(v: AttrValue) -> str:
    if isinstance(v, tuple):
        return json.dumps(list(v))
    return json.dumps(v)


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} {{"]
    for name, node in graph.items():
        text = f"  %{name} = {node.op}"
        operands = graph.operands(name)
        if operands:
            text += " " + ", ".join(f"%{o}" for o in operands)
        if node.attrs:
            text += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs) + "}"
        lines.append(f"{text} : {node.type}")
    lines.extend(f"  output {out} = %{value}" for out, value in graph.outputs)
    lines.append("}")
    return "\n".join(lines) + "\n"
