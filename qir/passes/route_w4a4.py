"""W4A4 routing: decides, per qlinear, whether its activations run 4-bit, and makes that
explicit in the IR.

Tiers (`--weight-quantization`): `declared` routes weights whose checkpoint declares 4-bit
activations; `w4a4` routes every weight whose format can take quantized activations (the
calibrated activation scale if the weight node carries one, else a per-row FP32 global scale
computed at run time); `w4a16` routes none. A routed qlinear either reads a new
`quantize_act %x` node (an explicit launch, shared later by share_act_quant; down_proj's input
is the product the gate/up pair stored), or, when its input is made by the SiLU-gate prologue
(the fallback for unmerged gate/up), quantizes in that prologue (`act_quant` attribute).

Preconditions: after the fusion passes (merged q/k/v or gate/up read one quantized input).
Static legality lives here: K % 64 == 0 and K <= 32768 (else the node stays 16-bit). The
dynamic one lives in the kernels and the interpreter: a batch of more than 64 rows runs the
16-bit path (W4A4_MAX_M).
Does not handle: weights of one merged node whose calibrated scales differ (they then share a
per-row scale: the producers this was built for share input scales across q/k/v and gate/up).

Experts (`expert_qlinear`) are routed by the same tiers and K rule, as an `act_quant`
attribute: each (row, slot)'s input is quantized inside the expert kernel under its own
expert's calibrated scale (qir.moe), so there is no quantize_act node to share.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.graph import AttrValue, Graph, Node, make_attrs
from qir.ops import ACT_SCALE_ATTRS, Op, operands
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, apply_rules
from qir.types import QActType, QExperts, QWeight, TensorType, WeightFormat

TIERS = ("declared", "w4a4", "w4a16")
MAX_K = 32768


def _weights(graph: Graph, value: str) -> list[str]:
    return list(operands(graph, value, "weights"))


def _scale_rule(graph: Graph, weights: list[str]) -> dict[str, AttrValue]:
    rules = [{k: v for k, v in graph.node(w).attrs if k in ACT_SCALE_ATTRS} for w in weights]
    return rules[0] if all(r == rules[0] for r in rules) else {}


def _routes_format(tier: str, fmt: WeightFormat) -> bool:
    """Whether `tier` runs this format's activations 4-bit (K permitting)."""
    if tier == "declared":
        return fmt.declared_act_bits() == 4
    return tier == "w4a4" and fmt.act_quant_scheme() is not None


@dataclass(frozen=True)
class RouteW4A4:
    tier: str = "declared"
    name: str = "route_w4a4"

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(
                f"unknown weight quantization tier {self.tier!r}; choose {', '.join(TIERS)}"
            )

    def _routable(self, graph: Graph, value: str) -> bool:
        node = graph.node(value)
        if (
            self.tier == "w4a16"
            or node.attr("act_quant")
            or isinstance(graph.node(graph.operands(value)[0]).type, QActType)
        ):
            return False
        formats = []
        for w in _weights(graph, value):
            t = graph.node(w).type
            assert isinstance(t, QWeight)
            formats.append(t)
        k = formats[0].in_features
        if k % 64 or k > MAX_K:
            return False
        return all(_routes_format(self.tier, t.format) for t in formats)

    def _route(self, rw: Rewriter, m: Match) -> bool:
        graph = rw.graph
        node = graph.node(m.root)
        weights = _weights(graph, m.root)
        w0 = graph.node(weights[0]).type
        assert isinstance(w0, QWeight)
        scheme = w0.format.act_quant_scheme()
        assert scheme is not None
        rule = _scale_rule(graph, weights)
        operands = graph.operands(m.root)
        if node.attr("prologue") == "silu_mul":
            rw.redefine(m.root, node.with_attrs(act_quant=scheme, **rule), operands)
            return True
        x = operands[0]
        xt = graph.node(x).type
        assert isinstance(xt, TensorType)
        xq = rw.insert(
            f"{x}_q",
            Node("quantize_act", QActType(scheme, xt), make_attrs(scheme=scheme, **rule)),
            [x],
        )
        rw.redefine(m.root, node, [xq, *operands[1:]])
        return True

    def _routable_experts(self, graph: Graph, value: str) -> bool:
        if self.tier == "w4a16" or graph.node(value).attr("act_quant"):
            return False
        w = graph.node(graph.operands(value)[1]).type
        assert isinstance(w, QExperts)
        k = w.in_features
        return not k % 64 and k <= MAX_K and _routes_format(self.tier, w.format)

    def _route_experts(self, rw: Rewriter, m: Match) -> bool:
        graph = rw.graph
        node = graph.node(m.root)
        w = graph.node(graph.operands(m.root)[1]).type
        assert isinstance(w, QExperts)
        scheme = w.format.act_quant_scheme()
        assert scheme is not None
        rw.redefine(
            m.root,
            node.with_attrs(act_quant=scheme),
            graph.operands(m.root),
        )
        return True

    def run(self, graph: Graph) -> int:
        rule = Rule("route_w4a4", Pat(Op.QLINEAR, check=self._routable), self._route)
        experts = Rule(
            "route_w4a4", Pat(Op.EXPERT_QLINEAR, check=self._routable_experts), self._route_experts
        )
        return apply_rules(graph, [rule, experts])
