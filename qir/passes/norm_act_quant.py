"""RMSNorm into the activation quantization (W4A4): `quantize_act(rms_norm(x, w))` becomes
`quantize_act(xn, x, w) {eps}`, one launch that normalises each row and writes the NVFP4 input
that q/k/v (or gate/up) share. The rms_norm node stays as operand 0: it is the 16-bit value the
quantized input stands for, which batches above W4A4_MAX_M (the 16-bit twins) read; its own
launch then only runs for those batches, so below that one launch is saved.

Preconditions: after route_w4a4 and share_act_quant (one quantize_act per input). Numerics are
unchanged: the kernel rounds the normalised values to the act dtype, as rms_norm stored them.
Does not fire: when the rms_norm result has readers other than quantize_acts, or is a block
output (its launch would run anyway: fusing would save nothing).
"""

from __future__ import annotations

from qir.graph import Graph
from qir.ops import Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass


def _only_quantized(graph: Graph, value: str) -> bool:
    return all(v != value for _, v in graph.outputs) and all(
        graph.node(u).op == Op.QUANTIZE_ACT for u in graph.users(value)
    )


def _fold(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    node = graph.node(m.root)
    rw.redefine(
        m.root, node.with_attrs(eps=graph.node(m["xn"]).attr("eps")), [m["xn"], m["x"], m["w"]]
    )
    return True


RULE = Rule(
    "norm_act_quant",
    Pat(
        Op.QUANTIZE_ACT,
        (Pat(Op.RMS_NORM, (Pat(name="x"), Pat(name="w")), name="xn", check=_only_quantized),),
    ),
    _fold,
)


NORM_ACT_QUANT = RulePass("norm_act_quant", (RULE,))
