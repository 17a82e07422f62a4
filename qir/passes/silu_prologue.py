"""SiLU-gate prologue: `qlinear(mul(silu(g), u), W)` (or `mul(u, silu(g))`), where the silu and
the mul each have that one use, becomes `qlinear g, u, W {prologue="silu_mul"}`: the kernel
computes silu(g[k]) * u[k] while it reads its input, so the product is never written.

Preconditions: a verified graph, after merge_parallel (g and u are typically `get`s of the
merged gate/up node) and silu_epilogue, which takes every gate/up pair it can: a prologue
recomputes silu(g) * u in every warp of the consumer, so this is the fallback for gate and up
that were not merged (other inputs or shapes; W4A4 weights of different formats). Under W4A4 route_w4a4 then has the
prologue quantize the product too (`act_quant`). Numerics are unchanged: the prologue rounds
silu(g) and the product to the act dtype exactly as the separate ops did.
Does not handle: a silu or mul with other users (the intermediate must exist anyway), a qlinear
that already has a prologue or epilogue, or several weights.
A gelu_tanh in the silu's place (Gemma's MLP) fuses the same way, the node's `act` naming it.
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import GATE_ACTS, Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _bare(graph: Graph, value: str) -> bool:
    node = graph.node(value)
    return node.attr("prologue") is None and node.attr("epilogue") is None


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    product = graph.operands(m.root)[0]
    silu = m["act"]
    gate = graph.node(silu).op  # silu, or gelu_tanh (Gemma): the node's `act`
    act = {} if gate == "silu" else {"act": gate}
    fused = (*node.attr("fused", ()), silu, product)
    rw.redefine(
        m.root, node.with_attrs(prologue="silu_mul", fused=fused, **act), [m["g"], m["u"], m["w"]]
    )
    return True


def _pattern(silu_first: bool, gate: str = "silu") -> Pat:
    silu = Pat(gate, (Pat(name="g"),), name="act", one_use=True)
    u = Pat(name="u")
    product = Pat(Op.MUL, (silu, u) if silu_first else (u, silu), one_use=True)
    return Pat(Op.QLINEAR, (product, Pat(Op.WEIGHT, name="w")), check=_bare)


RULES = tuple(
    rule
    for gate in GATE_ACTS
    for rule in (
        Rule(f"{gate}_prologue", _pattern(True, gate), _fold),
        Rule(f"{gate}_prologue_swapped", _pattern(False, gate), _fold),
    )
)


SILU_PROLOGUE = RulePass("silu_prologue", RULES)
