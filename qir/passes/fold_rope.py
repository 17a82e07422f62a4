"""Fold RoPE into its readers: `attention(rope(q, pos), kc, vc, pos)` becomes attention with the
rotation as a prologue (the kernel rotates q as it loads it), and `kv_append(kc, vc, rope(k,
pos), v, pos)` becomes a kv_append that rotates k as it writes the cache: two launches fewer per
layer, and the rotated q and k are never stored.

Preconditions: a verified graph. Numerics are unchanged: the prologues round the rotated values
to the act dtype, as the rope op stored them.
Does not fire: when the rope result has other users, when the rope and its reader take
different positions, or when the reader already rotates.
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _plain(graph: Graph, value: str) -> bool:
    return graph.node(value).attr("rope_type") is None


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    rope = dict(graph.node(m["r"]).attrs)
    operands = [m["x"] if o == m["r"] else o for o in graph.operands(m.root)]
    rw.redefine(m.root, graph.node(m.root).with_attrs(**rope), operands)
    return True


def _rope() -> Pat:
    return Pat(Op.ROPE, (Pat(name="x"), Pat(name="pos")), name="r", one_use=True)


ANY = Pat()
# Each op with and without a block table (its last operand).
RULES = tuple(
    Rule(name, Pat(op, (*operands, *paged), check=_plain), _fold)
    for paged in ((), (ANY,))
    for name, op, operands in (
        ("rope_into_attention", "attention", (_rope(), ANY, ANY, Pat(name="pos"))),
        ("rope_into_kv_append", "kv_append", (ANY, ANY, _rope(), ANY, Pat(name="pos"))),
    )
)


FOLD_ROPE = RulePass("fold_rope", RULES)
