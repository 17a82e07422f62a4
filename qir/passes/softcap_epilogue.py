"""Soft-cap epilogue: `softcap(qlinear(...))`, where the qlinear result has that one use, becomes
the qlinear with `epilogue="softcap"` and its `cap`: the kernel stores tanh(y / cap) * cap
(Gemma's final logit soft-capping is then the lm_head's store, not a launch of its own).

Preconditions: a verified graph. Numerics are unchanged: the projection is rounded to the act
dtype before the soft-cap, as the separate ops did.
Does not handle: a multi-output qlinear, or one that already has an epilogue.
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import TensorType


def _single_without_epilogue(graph: Graph, value: str) -> bool:
    node = graph.node(value)
    return (
        isinstance(node.type, TensorType)
        and node.attr("epilogue") is None
        and node.attr("prologue") != "silu_mul"
    )


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    q = graph.node(m["q"])
    fused = (*q.attr("fused", ()), m["q"])
    cap = graph.node(m.root).attr("cap")
    node = q.with_attrs(epilogue="softcap", cap=cap, fused=fused)
    rw.redefine(m.root, node, list(graph.operands(m["q"])))
    return True


RULES = (
    Rule(
        "softcap_epilogue",
        Pat(Op.SOFTCAP, (Pat(Op.QLINEAR, name="q", one_use=True, check=_single_without_epilogue),)),
        _fold,
    ),
)


SOFTCAP_EPILOGUE = RulePass("softcap_epilogue", RULES)
