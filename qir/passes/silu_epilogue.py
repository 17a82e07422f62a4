"""SiLU-gate epilogue: `mul(silu(get(q, i)), get(q, j))` (either operand order), where q is a
merged two-weight qlinear (gate and up of one shape, read from one input) and each get and the
silu have that one use, becomes `qlinear x, Wi, Wj {epilogue="silu_mul"}`: the kernel computes
row n of both weights in one warp and stores silu(g) * u, so g and u are never written and
silu runs once per element.

Why an epilogue and not down_proj's prologue (silu_prologue): a prologue recomputes silu(g) * u
for the whole input in every warp of down_proj, one per output row: at Llama-3-8B shapes that
is 4096 x 14336 exp and reciprocal per token (two SFU instructions per element in the SASS),
by estimate several times the time down_proj needs to stream its weights (not yet measured:
benchmarks/llama_shapes.py compares both); here it is 14336. Under W4A4
the prologue would also quantize the product to NVFP4 in every warp; instead route_w4a4 gives
down_proj one quantize_act launch of the stored product (one more launch, shared work).

Gate and up of two formats (merge_parallel merges them) pair too: the kernel runs the gate's
format's code over a block's rows, then the up's over the same rows (codegen.gemv.GemvSpec.parts).

Preconditions: a verified graph, after merge_parallel, before silu_prologue (which takes what
this pass cannot: gate and up that were not merged) and route_w4a4.
Numerics are unchanged: g and u are rounded to the act dtype, then silu(g) and the product, as
the separate ops did.
Does not fire: on merged nodes of other than two weights or of weights of different shapes, on
a node that already has a prologue or epilogue, or when a get or the silu has other users.
A gelu_tanh in the silu's place (Gemma's MLP) fuses the same way, the node's `act` naming it.
"""

from __future__ import annotations

import dataclasses

from qir.graph import Graph
from qir.ops import GATE_ACTS, Op, layout
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import TupleType


def _pair(graph: Graph, value: str) -> bool:
    node = graph.node(value)
    return (
        node.attr("prologue") is None
        and node.attr("epilogue") is None
        and isinstance(node.type, TupleType)
        and len(node.type.elements) == 2
        and node.type.elements[0] == node.type.elements[1]
        and graph.use_count(value) == 2
    )


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    q = graph.node(m["q"])
    operands = graph.operands(m["q"])
    segments = layout(graph, m["q"])
    ins, weights = segments["inputs"], operands[segments["weights"]]
    # Two different gets: the verifier allows one get per result, so i != j.
    i, j = graph.node(m["g"]).attr("index"), graph.node(m["u"]).attr("index")
    # The gets carry the names of the projections merge_parallel merged: listed once.
    fused = tuple(dict.fromkeys((*q.attr("fused", ()), m["q"], m["g"], m["silu"], m["u"])))
    # gelu_tanh (Gemma) as the gate's activation is the same fusion with the node's `act`
    gate = graph.node(m["silu"]).op
    act = {} if gate == "silu" else {"act": gate}
    node = dataclasses.replace(q, type=graph.node(m.root).type).with_attrs(
        epilogue="silu_mul", fused=fused, **act
    )
    rw.redefine(m.root, node, [*operands[ins], weights[i], weights[j]])
    return True


def _pattern(silu_first: bool, gate: str = "silu") -> Pat:
    q = Pat(Op.QLINEAR, name="q", check=_pair)
    g = Pat(gate, (Pat(Op.GET, (q,), name="g", one_use=True),), name="silu", one_use=True)
    u = Pat(Op.GET, (Pat(name="q"),), name="u", one_use=True)
    return Pat(Op.MUL, (g, u) if silu_first else (u, g))


RULES = tuple(
    rule
    for gate in GATE_ACTS
    for rule in (
        Rule(f"{gate}_epilogue", _pattern(True, gate), _fold),
        Rule(f"{gate}_epilogue_swapped", _pattern(False, gate), _fold),
    )
)


SILU_EPILOGUE = RulePass("silu_epilogue", RULES)
