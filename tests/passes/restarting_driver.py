"""The oracle for the worklist driver: how qir applied rules and ran DCE and share_act_quant's
check before compile times mattered (up to commit c30ee67). After every rewrite it rescans
the whole program order from the start, so a pass costs O(rewrites x nodes); its result is
what every pass must still produce. Test code only: it must never be fast, only obviously right.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import networkx as nx
import pytest

from qir.graph import Graph
from qir.passes import dce, rewrite, share_act_quant
from qir.passes.rewrite import Rewriter, Rule, match

MAX_REWRITES = 10_000


def apply_rules(graph: Graph, rules: Sequence[Rule]) -> int:
    """Fire the first rule that matches at the first node, in program order, that any matches;
    start again from the top; until nothing matches."""
    fired = 0
    rw = Rewriter(graph)
    changed = True
    while changed:
        changed = False
        for value in graph.order():
            for rule in rules:
                m = match(graph, rule.pattern, value)
                rw.root = value  # the only addition: nodes it makes get their order keys
                if m is not None and rule.rewrite(rw, m):
                    rw.sweep()
                    rw.changed.clear()
                    fired += 1
                    changed = True
                    break
            if changed:
                break
        if fired > MAX_REWRITES:
            raise RuntimeError(f"rewrite rules {[r.name for r in rules]} did not reach a fixpoint")
    return fired


def has_earlier_twin(graph: Graph, value: str) -> bool:
    twin = share_act_quant._twin(graph, value)
    return twin is not None and graph.order().index(twin) < graph.order().index(value)


def dce_run(self: dce.DCE, graph: Graph) -> int:
    live: set[str] = set()
    for _, value in graph.outputs:
        live.add(value)
        live |= nx.ancestors(graph.g, value)
    dead = [n for n in graph.g if n not in live and graph.node(n).op != "input"]
    graph.remove_all(dead)
    return len(dead)


@contextmanager
def restarting() -> Iterator[None]:
    """Every pass runs on the oracle's driver (and DCE, share_act_quant on their old code)."""
    import sys

    with pytest.MonkeyPatch.context() as mp:
        for name, module in list(sys.modules.items()):
            patched = getattr(module, "apply_rules", None) is rewrite.apply_rules
            if name.startswith("qir.passes.") and module is not rewrite and patched:
                mp.setattr(module, "apply_rules", apply_rules)
        mp.setattr(share_act_quant, "_has_earlier_twin", has_earlier_twin)
        mp.setattr(dce.DCE, "run", dce_run)
        yield
