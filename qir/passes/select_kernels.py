"""Kernel selection: the last pass; labels each qlinear (and expert_qlinear) with the kernel families that run it and
the batch size at which the tensor-core GEMM takes over from the GEMV.

A block is compiled once for a symbolic M, so the choice is made per run: the label is a range
split, `kernel="gemv|gemm"` with `gemm_from_m=N` (GEMV below N rows, GEMM from N), `kernel="gemv"`
(every M: f32 activations, which the GEMM family does not take) or `kernel="gemm"` (N = 1).
Lowering emits one launch per family and range (`Launch.when`), the executor picks per run.

Preconditions: fusion and W4A4 routing done (a W4A4 node's crossover is its own row of the
table). Does not handle: per-shape crossovers (the table is per format; N and K pick the GEMM's
tiles in codegen, not the family). Fires once per qlinear it labels; labelled nodes are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.dtypes import F32
from qir.graph import AttrValue, Graph, Node
from qir.ops import Op
from qir.ops import operands as segment
from qir.types import QActType, QExperts, QWeight, TensorType, TupleType

FAMILIES = ("gemv", "gemv|gemm", "gemm")

# The crossover table: the first M at which the GEMM family runs, by the weight format's
# fragment, and for NVFP4 weights with 4-bit activations. Defaults set by reasoning, to be
# replaced by `benchmarks/llama_shapes.py` measurements on a GPU: the GEMV's launch covers 8 rows
# and re-reads the weights for every 8 more (from L2 while they fit), the GEMM reads them once
# per 64 rows but dequantizes them into shared memory; the W4A4 GEMV's products are exact E2M1
# pairs whose sums a tensor core forms as cheaply, so the GEMM takes over from the second 8 rows.
GEMM_FROM_M: dict[str, int] = {
    "mlx_affine": 17,
    "awq": 17,
    "gptq": 17,
    "ct_int": 17,
    "nvfp4": 17,
    "nvfp4 w4a4": 9,
    "mxfp4": 17,
    "mxfp8": 17,
    "fp8": 17,
    "fp8_block": 17,
    "dense": 17,
    "ggml": 17,
}


def gemm_from_m(graph: Graph, name: str) -> int | None:
    """The table's crossover for qlinear `name`, or None when the GEMM cannot run it."""
    node = graph.node(name)
    out = node.type.elements[0] if isinstance(node.type, TupleType) else node.type
    assert isinstance(out, TensorType)
    if out.dtype == F32:
        return None
    operands = graph.operands(name)
    if node.op == Op.EXPERT_QLINEAR:  # the grouped GEMM from the same M as a plain one
        w = graph.node(segment(graph, name, "weights")[0]).type
        assert isinstance(w, QExperts)
        return GEMM_FROM_M[w.format.fragment]
    w = graph.node(segment(graph, name, "weights")[0]).type
    assert isinstance(w, QWeight)
    a4 = isinstance(graph.node(operands[0]).type, QActType) or node.attr("act_quant") is not None
    return GEMM_FROM_M[w.format.fragment + (" w4a4" if a4 else "")]


def label(node: Node, first_gemm_m: int | None) -> Node:
    """`node` labelled for a GEMM from M = first_gemm_m on (None: GEMV only)."""
    attrs: dict[str, AttrValue] = {"kernel": "gemv"}
    if first_gemm_m is not None:
        attrs = {"kernel": "gemm" if first_gemm_m <= 1 else "gemv|gemm"}
        attrs["gemm_from_m"] = max(first_gemm_m, 1)
    return node.with_attrs(**attrs)


@dataclass(frozen=True)
class SelectKernels:
    # Tests and benchmarks move the crossover of every node to this M (None: the table's).
    gemm_from_m: int | None = None
    name: str = "select_kernels"

    def run(self, graph: Graph) -> int:
        fired = 0
        for name, node in graph.items():
            if node.op in (Op.QLINEAR, Op.EXPERT_QLINEAR) and node.attr("kernel") is None:
                first = gemm_from_m(graph, name)
                if first is not None and self.gemm_from_m is not None:
                    first = self.gemm_from_m
                graph.set_node(name, label(node, first))
                fired += 1
        return fired
