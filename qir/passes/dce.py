"""Dead code elimination.

Preconditions: a verified graph. Removes every node from which no output is reachable, except
inputs: they are the block's calling signature, which passes must not change. Fires once per
removed node. One walk from the outputs towards the inputs: linear in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.graph import Graph


@dataclass(frozen=True)
class DCE:
    name: str = "dce"

    def run(self, graph: Graph) -> int:
        live = {value for _, value in graph.outputs}
        work = list(live)
        while work:
            for o in graph.operands(work.pop()):
                if o not in live:
                    live.add(o)
                    work.append(o)
        dead = [n for n in graph.g if n not in live and graph.node(n).op != "input"]
        graph.remove_all(dead)
        return len(dead)
