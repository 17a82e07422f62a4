"""Dead code elimination.

Preconditions: a verified graph. Removes every node from which no output is reachable, except
inputs (the block's calling signature, which passes must not change) and kv_appends with what
they read (writing a KV cache is an effect the next run sees). Fires once per removed node.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from qir.graph import Graph


@dataclass(frozen=True)
class DCE:
    name: str = "dce"

    def run(self, graph: Graph) -> int:
        live: set[str] = set()
        effects = [n for n in graph.g if graph.node(n).op == "kv_append"]
        for value in [v for _, v in graph.outputs] + effects:
            live.add(value)
            live |= nx.ancestors(graph.g, value)
        dead = [n for n in graph.g if n not in live and graph.node(n).op != "input"]
        graph.g.remove_nodes_from(dead)
        return len(dead)
