"""The arguments an expert qlinear's kernels share (the expert GEMV and the grouped GEMM): its
inputs, its stacked weights' buffers and its norm prologue."""

from __future__ import annotations

from collections.abc import Sequence

from qir.codegen.plan import Arg
from qir.dtypes import DType
from qir.graph import Graph
from qir.types import QExperts, TensorType


def tensor_of(graph: Graph, name: str) -> TensorType:
    t = graph.node(name).type
    assert isinstance(t, TensorType)
    return t


def expert_weight_args(
    names: Sequence[str], experts: Sequence[QExperts], buffers: Sequence[str]
) -> tuple[Arg, ...]:
    """Each stacked weight's format buffers, then its bias where it has one (the expert
    kernels' parameter order)."""
    return tuple(
        arg
        for w, e in zip(names, experts, strict=True)
        for arg in (
            *(Arg("weight", w, b) for b in buffers),
            *((Arg("weight", w, "bias"),) if e.expert.bias else ()),
        )
    )


def norm_of(graph: Graph, name: str) -> tuple[DType, float] | None:
    """An expert qlinear's rms_norm prologue as the kernels' specs take it (the norm weight's
    dtype, eps), or None."""
    node = graph.node(name)
    if node.attr("prologue") != "rms_norm":
        return None
    nw, eps = tensor_of(graph, graph.operands(name)[1]), node.attr("eps")
    assert isinstance(eps, float)
    return nw.dtype, eps


def input_args(graph: Graph, name: str) -> tuple[Arg, ...]:
    """An expert kernel's input arguments: x, then the norm's weight with the prologue."""
    operands = graph.operands(name)
    if graph.node(name).attr("prologue") == "rms_norm":
        return Arg("value", operands[0]), Arg("weight", operands[1], "weight")
    return (Arg("value", operands[0]),)
