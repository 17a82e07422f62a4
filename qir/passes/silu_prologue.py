"""SiLU-gate prologue: `qlinear(mul(silu(g), u), W)` (or `mul(u, silu(g))`), where the silu and
the mul each have that one use, becomes `qlinear g, u, W {prologue="silu_mul"}`: the kernel
computes silu(g[k]) * u[k] while it reads its input, so the product is never written.

Preconditions: a verified graph, after merge_parallel (g and u are typically `get`s of the
merged gate/up node) and silu_epilogue, which takes every gate/up pair it can: a prologue
recomputes silu(g) * u in every warp of the consumer, so this is the fallback for gate and up
that were not merged (different formats or shapes). Under W4A4 route_w4a4 then has the
prologue quantize the product too (`act_quant`). Numerics are unchanged: the prologue rounds
silu(g) and the product to the act dtype exactly as the separate ops did.
Does not handle: a silu or mul with other users (the intermediate must exist anyway), a qlinear
that already has a prologue or epilogue, or several weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.graph import Graph
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, apply_rules


def _bare(graph: Graph, value: str) -> bool:
    node = graph.node(value)
    return node.attr("prologue") is None and node.attr("epilogue") is None


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    product = graph.operands(m.root)[0]
    silu = next(o for o in graph.operands(product) if graph.node(o).op == "silu")
    fused = (*node.attr("fused", ()), silu, product)
    rw.redefine(m.root, node.with_attrs(prologue="silu_mul", fused=fused), [m["g"], m["u"], m["w"]])
    return True


def _pattern(silu_first: bool) -> Pat:
    silu = Pat("silu", (Pat(name="g"),), one_use=True)
    u = Pat(name="u")
    product = Pat("mul", (silu, u) if silu_first else (u, silu), one_use=True)
    return Pat("qlinear", (product, Pat("weight", name="w")), check=_bare)


RULES = (
    Rule("silu_prologue", _pattern(silu_first=True), _fold),
    Rule("silu_prologue_swapped", _pattern(silu_first=False), _fold),
)


@dataclass(frozen=True)
class SiluPrologue:
    name: str = "silu_prologue"

    def run(self, graph: Graph) -> int:
        return apply_rules(graph, RULES)
