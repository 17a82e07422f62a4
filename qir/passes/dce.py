"""Dead code elimination.

Preconditions: a verified graph. Removes every node from which no output is reachable, except
inputs (the block's calling signature, which passes must not change) and kv_appends with what
they read (writing a KV cache is an effect the next run sees). Fires once per removed node. One
walk from the outputs and kv_appends towards the inputs: linear in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.graph import Graph
from qir.ops import Op


@dataclass(frozen=True)
class DCE:
    name: str = "dce"

    def run(self, graph: Graph) -> int:
        live = {value for _, value in graph.outputs}
        live |= {n for n in graph.g if graph.node(n).op == Op.KV_APPEND}
        work = list(live)
        while work:
            for o in graph.operands(work.pop()):
                if o not in live:
                    live.add(o)
                    work.append(o)
        dead = [n for n in graph.g if n not in live and graph.node(n).op != Op.INPUT]
        graph.remove_all(dead)
        return len(dead)
