"""Fold a per-head RMSNorm into the reader that already rotates: `attention(rms_norm(q, w), ...)`
and `kv_append(kc, vc, rms_norm(k, w), v, pos)`, with w [head_dim] (Qwen3's and Gemma 3's
q_norm / k_norm), take the norm as a prologue (the weight as a last operand, attribute
norm_eps): attention normalises each head of q as it loads it, the append each head of k as it
writes the cache, before the rotation fold_rope put there. Two launches fewer per layer; the
normed q and k are never stored.

Preconditions: a verified graph, after fold_rope (which leaves the norm as the reader's first
input). Numerics are unchanged: the prologue rounds the normed head to the act dtype, as the
rms_norm op stored it, before rotating.
Does not fire: on a norm of whole rows (or of groups other than the cache's head_dim), when the
norm's result has other users, or when the reader already normalises.
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op, layout
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import TensorType


def _plain(graph: Graph, value: str) -> bool:
    return graph.node(value).attr("norm_eps") is None


def _per_head(graph: Graph, value: str) -> bool:
    w = graph.node(graph.operands(value)[1]).type
    x = graph.node(value).type
    return isinstance(w, TensorType) and isinstance(x, TensorType) and w.shape[0] != x.shape[1]


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    cache = graph.node(graph.operands(m.root)[1]).type  # k_cache for either reader
    w = graph.node(m["w"]).type
    assert isinstance(cache, TensorType) and isinstance(w, TensorType)
    if w.shape[0] != cache.shape[2]:
        return False  # groups other than heads: not this kernel's prologue
    eps = graph.node(m["n"]).attr("eps")
    operands = [m["x"] if o == m["n"] else o for o in graph.operands(m.root)]
    # the norm weight goes before attention's sinks, the last optional operand
    at = layout(graph, m.root)["norm"].start
    operands.insert(at, m["w"])
    rw.redefine(m.root, node.with_attrs(norm_eps=eps), operands)
    return True


def _norm() -> Pat:
    return Pat(Op.RMS_NORM, (Pat(name="x"), Pat(name="w")), name="n", one_use=True, check=_per_head)


ANY = Pat()
# Each op with and without a block table (then its last operand, before the norm's weight).
RULES = tuple(
    Rule(name, Pat(op, (*operands, *paged), check=_plain), _fold)
    for paged in ((), (ANY,))
    for name, op, operands in (
        ("head_norm_into_attention", "attention", (_norm(), ANY, ANY, ANY)),
        ("head_norm_into_kv_append", "kv_append", (ANY, ANY, _norm(), ANY, ANY)),
    )
)


FOLD_HEAD_NORM = RulePass("fold_head_norm", RULES)
