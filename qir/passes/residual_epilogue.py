"""Residual epilogue: `add(r, qlinear(...))` (either operand order), where the qlinear result has
that one use, becomes the qlinear with `epilogue="residual"` and r as its last operand: the
kernel adds r[m, n] as it stores y[m, n]. Composes with the SiLU-gate prologue
(`y = r + down(silu(g) * u)` is one kernel).

Preconditions: a verified graph; runs after silu_prologue. Numerics are unchanged: the
projection is rounded to the act dtype before the add, as the separate ops did.
Does not handle: a multi-output qlinear, one that already has an epilogue, or an add whose
operands are both such qlinears twice over (the second operand is fused first).
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import TensorType


def _single_without_epilogue(graph: Graph, value: str) -> bool:
    node = graph.node(value)
    return isinstance(node.type, TensorType) and node.attr("epilogue") is None


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    q = graph.node(m["q"])
    fused = (*q.attr("fused", ()), m["q"])
    rw.redefine(
        m.root, q.with_attrs(epilogue="residual", fused=fused), [*graph.operands(m["q"]), m["r"]]
    )
    return True


def _pattern(q_second: bool) -> Pat:
    q = Pat(Op.QLINEAR, name="q", one_use=True, check=_single_without_epilogue)
    r = Pat(name="r")
    return Pat(Op.ADD, (r, q) if q_second else (q, r))


RULES = (
    Rule("residual_epilogue", _pattern(q_second=True), _fold),
    Rule("residual_epilogue_swapped", _pattern(q_second=False), _fold),
)


RESIDUAL_EPILOGUE = RulePass("residual_epilogue", RULES)
