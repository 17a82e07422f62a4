"""A norm_residual read through an rms_norm prologue joins that prologue: `qlinear(h, w, W...
{prologue="rms_norm"})` with `h = norm_residual(x, pw, r)` becomes `qlinear x, pw, r, w, W...
{prologue="norm_residual", res_eps}`, whose kernel forms h from x and r as it reads its input,
normalises h for the projections and stores h as its last result (its first N block does) for
h's other readers. Gemma's post-attention norm and its residual add thus ride in the gate/up
launch, and the post-feedforward ones in the next layer's q/k/v (or lm_head): the post-norms add
no launch to a model (a lone layer keeps the last one, whose h nothing reads through a prologue).

Preconditions: after norm_residual and norm_prologue (it takes what they made). Numerics are
unchanged: h is rounded to the act dtype before it is normalised, as norm_residual stores it.
Does not fire: on a norm_residual that two such prologues read (each launch would store h), or
on a qlinear whose rms_norm prologue reads anything else.
"""

from __future__ import annotations

from qir.graph import Graph, Node
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import TensorType, TupleType


def _reads_through_prologue(graph: Graph, user: str, value: str) -> bool:
    node = graph.node(user)
    return (
        node.op == Op.QLINEAR
        and node.attr("prologue") == "rms_norm"
        and graph.operands(user)[0] == value
    )


def _candidate(graph: Graph, name: str) -> bool:
    if graph.node(name).attr("prologue") != "rms_norm":
        return False
    h = graph.operands(name)[0]
    return (
        graph.node(h).op == Op.NORM_RESIDUAL
        and sum(_reads_through_prologue(graph, u, h) for u in graph.users(h)) == 1
    )


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    h, nw, *weights = graph.operands(m.root)
    res = graph.node(h)
    assert isinstance(res.type, TensorType)
    ys = node.type.elements if isinstance(node.type, TupleType) else (node.type,)
    fused = Node(
        "qlinear",
        TupleType((*ys, res.type)),
        node.with_attrs(
            prologue="norm_residual",
            res_eps=res.attr("eps"),
            fused=(*node.attr("fused", ()), *res.attr("fused", ()), h),
        ).attrs,
    )
    operands = [*graph.operands(h), nw, *weights]
    if isinstance(node.type, TupleType):
        # The qlinear's gets keep their indices: h is appended after its results.
        rw.redefine(m.root, fused, operands)
        at = m.root
    else:
        at = rw.insert(m.root, fused, operands)
        rw.redefine(m.root, Node("get", node.type).with_attrs(index=0), [at])
    rw.redefine(h, Node("get", res.type).with_attrs(index=len(ys)), [at])
    return True


RULE = Rule("norm_residual_prologue", Pat(Op.QLINEAR, check=_candidate), _fold)


NORM_RESIDUAL_PROLOGUE = RulePass("norm_residual_prologue", (RULE,))
