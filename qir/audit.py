"""W4A4 audit: how much each 4-bit-activation projection departs from its 16-bit twin and from
a float32 reference, so a user can see which layers W4A4 hurts before deploying it.

Per projection routed to W4A4 (in the unfused graph, so each projection is its own node; an
expert projection is one node for all its experts, [M, k, N] or combined):
  w4a4 vs w4a16 = ||y_w4a4 - y_w4a16|| / ||y_w4a16||
  w4a4 vs f32, w4a16 vs f32: the same against the block run with float32 activations and
  16-bit (unquantized) activations.
Numbers come from the reference interpreter, which the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from qir.dtypes import F32
from qir.graph import Graph
from qir.interpret import Weights, evaluate
from qir.ops import W4A4_MAX_M, Op
from qir.passes.manager import PassOptions, run_pipeline
from qir.types import QActType, TensorType, TupleType


@dataclass(frozen=True)
class AuditRow:
    node: str
    w4a4_vs_w4a16: float
    w4a4_vs_f32: float
    w4a16_vs_f32: float


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    b32 = b.astype(np.float32)
    return float(
        np.linalg.norm(a.astype(np.float32) - b32) / max(float(np.linalg.norm(b32)), 1e-30)
    )


def _as_f32(graph: Graph) -> Graph:
    """The same block with float32 activations everywhere."""
    g = graph.copy()
    for name, node in g.items():
        t = node.type
        if isinstance(t, TensorType):
            g.set_node(name, replace(node, type=TensorType(t.shape, F32)))
        elif isinstance(t, TupleType):
            g.set_node(
                name,
                replace(node, type=TupleType(tuple(TensorType(e.shape, F32) for e in t.elements))),
            )
    return g


def audit(
    graph: Graph, weights: Weights, inputs: Mapping[str, np.ndarray], tier: str = "declared"
) -> list[AuditRow]:
    """One row per projection that `tier` routes to W4A4; empty when none is (or when the batch
    has more than W4A4_MAX_M rows, where W4A4 launches fall back to 16-bit)."""
    routed_graph, _ = run_pipeline(graph, ("route_w4a4",), options=PassOptions(tier))
    routed = [
        n
        for n in routed_graph.of_op(Op.QLINEAR)
        if isinstance(routed_graph.node(routed_graph.operands(n)[0]).type, QActType)
    ] + [n for n in routed_graph.of_op(Op.EXPERT_QLINEAR) if routed_graph.node(n).attr("act_quant")]
    if not routed or any(a.shape[0] > W4A4_MAX_M for a in inputs.values()):
        return []
    y4 = evaluate(routed_graph, inputs, weights)
    y16 = evaluate(graph, inputs, weights)
    y32 = evaluate(_as_f32(graph), {k: v.astype(np.float32) for k, v in inputs.items()}, weights)
    return [
        AuditRow(n, _rel(y4[n], y16[n]), _rel(y4[n], y32[n]), _rel(y16[n], y32[n])) for n in routed
    ]
