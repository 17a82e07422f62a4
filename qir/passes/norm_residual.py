"""Norm before a residual add: `add(r, rms_norm(x, w))` (either operand order), where the norm
has that one use, becomes `norm_residual x, w, r`: one kernel normalises the row and adds r as
it stores it (Gemma's post-attention and post-feedforward norms), where the norm and the add
were two launches.

Preconditions: a verified graph; runs after residual_epilogue (whose add(r, qlinear) an
add(r, rms_norm) never is). Numerics are unchanged: the norm is rounded to the act dtype before
the add, as the separate ops did.
Does not handle: a norm with other users (its result must exist anyway).
"""

from __future__ import annotations

from qir.graph import Node
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    norm = graph.node(m["norm"])
    fused = (*norm.attr("fused", ()), m["norm"])
    node = Node("norm_residual", graph.node(m.root).type, norm.attrs).with_attrs(fused=fused)
    rw.redefine(m.root, node, [*graph.operands(m["norm"]), m["r"]])
    return True


def _pattern(norm_second: bool) -> Pat:
    norm = Pat(Op.RMS_NORM, name="norm", one_use=True)
    r = Pat(name="r")
    return Pat(Op.ADD, (r, norm) if norm_second else (norm, r))


RULES = (
    Rule("norm_residual", _pattern(norm_second=True), _fold),
    Rule("norm_residual_swapped", _pattern(norm_second=False), _fold),
)


NORM_RESIDUAL = RulePass("norm_residual", RULES)
