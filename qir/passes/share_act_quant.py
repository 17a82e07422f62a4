"""Quantize a shared activation once: `quantize_act` nodes with the same input and the same
scale rule (scheme and calibrated scale attributes) become one node.

Structural CSE, so a consumer can never read a quantization of a different tensor (a runtime
"same input address" check can, once a buffer is reused). Preconditions: after route_w4a4.
Does not handle: equal rules spelled differently (input_scale vs its reciprocal
input_global_scale round differently, so they are different rules).
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _twin(graph: Graph, value: str) -> str | None:
    node = graph.node(value)
    (x,) = graph.operands(value)
    for other in graph.users(x):
        if other != value and graph.node(other) == node:
            return other
    return None


def _has_earlier_twin(graph: Graph, value: str) -> bool:
    # Twins read one value, so they become ready together in the program order's topological
    # sort, which then takes the smaller order key first: comparing keys is comparing places.
    twin = _twin(graph, value)
    return twin is not None and graph.order_key(twin) < graph.order_key(value)


def _share(rw: Rewriter, m: Match) -> bool:
    twin = _twin(rw.graph, m.root)
    assert twin is not None
    rw.replace(m.root, twin)
    return True


RULE = Rule("share_act_quant", Pat(Op.QUANTIZE_ACT, check=_has_earlier_twin), _share)
SHARE_ACT_QUANT = RulePass("share_act_quant", (RULE,))
