"""RMSNorm as the prologue of the projections that read it (16-bit activations):
`qlinear(rms_norm(x, w), W...)` becomes `qlinear x, w, W... {prologue="rms_norm", eps}`: the
kernel normalises each row of x while it reads it, so the normalised activation is never written
and the norm's own launch goes. In a decoder layer that is the input norm before the merged
q/k/v and the post-attention norm before the gate/up pair (and the final norm before lm_head).
A mixture of experts' post-attention norm is read by the router (a qlinear, merged with a
shared expert's gate) and by the experts' gate/up, `expert_qlinear(rms_norm(x, w), W, W_up,
ids)`, which becomes `expert_qlinear x, w, W, W_up, ids {prologue="rms_norm", eps}` (and by a
shared expert's gate/up, a plain qlinear): the expert GEMVs and grouped GEMMs normalise the rows
they gather, so a MoE layer's norm has no launch of its own either.

Preconditions: after merge_parallel and silu_epilogue (one merged node per shared input, so the
norm is recomputed by one launch, not one per projection) and after the W4A4 passes
(route_w4a4, share_act_quant, norm_act_quant), which own norms that feed 4-bit activations.
Numerics are unchanged: the kernel rounds the normalised row to the act dtype as rms_norm stores
it. Does not fire: when the rms_norm result is a block output or has a reader that is not such a
qlinear or expert_qlinear (a quantize_act, a residual operand, an expert qlinear with a combine
or reading it as anything but its input, another op: the value must exist anyway), or on a
reader that already has a prologue or quantizes its input.
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _reads_as_input(graph: Graph, user: str, value: str) -> bool:
    node = graph.node(user)
    operands = graph.operands(user)
    takes = node.op == Op.QLINEAR or (
        # the expert kernels that read a row per token; a combine's input is a row per slot
        node.op == Op.EXPERT_QLINEAR
        and node.attr("epilogue") not in ("combine", "combine_residual")
    )
    return (
        takes
        and node.attr("prologue") is None
        and node.attr("act_quant") is None
        and operands[0] == value
        and value not in operands[1:]
    )


def _candidate(graph: Graph, name: str) -> bool:
    xn = graph.operands(name)[0]
    return (
        graph.node(xn).op == Op.RMS_NORM
        and all(v != xn for _, v in graph.outputs)
        and all(_reads_as_input(graph, u, xn) for u in graph.users(xn))
    )


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    xn, *rest = graph.operands(m.root)
    x, w = graph.operands(xn)
    fused = (*node.attr("fused", ()), xn)
    attrs = node.with_attrs(prologue="rms_norm", eps=graph.node(xn).attr("eps"), fused=fused)
    rw.redefine(m.root, attrs, [x, w, *rest])
    return True


RULE = Rule("norm_prologue", Pat(Op.QLINEAR, check=_candidate), _fold)
EXPERTS_RULE = Rule("norm_prologue", Pat(Op.EXPERT_QLINEAR, check=_candidate), _fold)


NORM_PROLOGUE = RulePass("norm_prologue", (RULE, EXPERTS_RULE))
