"""Lowering of the mixture-of-experts ops: route (one warp per row), and expert_qlinear by the
node's kernel label (select_kernels): the expert GEMVs below gemm_from_m rows (qir.codegen.moe),
the grouped path from there (qir.codegen.moe_gemm: the router's ids grouped by expert once,
shared by every expert launch that reads those ids, then a grouped GEMM per expert qlinear and,
for a combine, a combine launch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qir.codegen import moe
from qir.codegen.expert_args import expert_weight_args, input_args, norm_of, tensor_of
from qir.codegen.gemv import for_target
from qir.codegen.moe_gemm import lower_grouped
from qir.codegen.plan import ALL_M, DEFAULT_M_TILE, Arg, Launch, results
from qir.codegen.quantize_act import MODES
from qir.graph import Graph
from qir.ops import W4A4_MAX_M, layout
from qir.target import Target
from qir.types import QExperts, TensorType

Lowered = tuple[list[Launch], dict[str, TensorType]]


def lower_route(graph: Graph, name: str, _: Mapping[str, TensorType], __: Target) -> Lowered:
    (logits,) = graph.operands(name)
    t = tensor_of(graph, logits)
    experts = t.shape[1]
    assert isinstance(experts, int)
    node = graph.node(name)
    temps: dict[str, TensorType] = {}
    ids, weights = results(graph, name, temps)
    kernel = moe.route_kernel(t.dtype, experts, node.attr("k"), node.attr("rule"))
    args = (Arg("value", logits), Arg("value", ids), Arg("value", weights), Arg("M"))
    return [Launch(kernel, 1, 1, args, (ids, weights), (name,))], temps


def lower_expert_qlinear(
    graph: Graph, name: str, temps: Mapping[str, TensorType], target: Target
) -> Lowered:
    """The expert GEMV below gemm_from_m rows, the grouped path from there; both specialised
    for `target` where its FP4 conversion changes the experts' decode (as the dense kernels).
    W4A4 experts (act_quant) run the W4A4 expert GEMV up to W4A4_MAX_M rows whatever the
    label, the label's 16-bit families above."""
    node = graph.node(name)
    operands = graph.operands(name)
    types = [graph.node(o).type for o in operands]
    segments = layout(graph, name)
    ws, at = segments["weights"], segments["ids"].start
    experts = tuple(t for t in types[ws] if isinstance(t, QExperts))
    ids = operands[at]
    top = tensor_of(graph, ids).shape[1]
    assert isinstance(top, int)
    x = tensor_of(graph, operands[0])
    combine = (
        node.attr("epilogue") if node.attr("epilogue") in ("combine", "combine_residual") else ""
    )
    first_gemm = node.attr("gemm_from_m")
    gemm_from = first_gemm if isinstance(first_gemm, int) else ALL_M[1] + 1
    w0 = experts[0].expert
    specialised = for_target(target, w0.format, w0.out_features, w0.in_features)
    launches: list[Launch] = []
    new_temps: dict[str, TensorType] = {}
    covers = (name, *node.attr("fused", ()))

    def gemv(when: tuple[int, int], a4_mode: str = "") -> None:
        spec = moe.ExpertGemvSpec(
            experts,
            tensor_of(graph, name).dtype,
            DEFAULT_M_TILE,
            top,
            combine,
            x.rank == 3,
            target=specialised,
            gate_act=moe.expert_act(dict(node.attrs)),
            norm=norm_of(graph, name),
            a4_mode=a4_mode,
        )
        # the gate's experts' scales (the up experts' are the same: qir.moe)
        scale = [Arg("weight", operands[ws][0], "input_scale")] if a4_mode in MODES.values() else []
        args = (
            *input_args(graph, name),
            *expert_weight_args(operands[ws], experts, spec.fragment.buffers),
            *scale,
            *(Arg("value", v) for v in operands[at:]),
            Arg("value", name),
            Arg("M"),
        )
        kernel = moe.expert_gemv_kernel(spec)
        if combine:
            launches.append(Launch(kernel, spec.grid_x, spec.m_tile, args, (name,), covers, when))
        else:
            launches.append(
                Launch(kernel, spec.grid_x, 1, args, (name,), covers, when, rows_per_m=0, extra_y=1)
            )

    lo = 1
    if node.attr("act_quant") is not None:
        # W4A4 up to W4A4_MAX_M rows on the expert GEMV, which quantizes each slot's input as it
        # reads it (there is no W4A4 grouped GEMM: the label's families run the 16-bit rest).
        attr = w0.format.act_scale_attr()
        gemv((1, W4A4_MAX_M), MODES[attr] if attr else "dynamic")
        lo = W4A4_MAX_M + 1
    if lo < gemm_from:
        gemv((lo, min(ALL_M[1], gemm_from - 1)))
    if gemm_from <= ALL_M[1]:
        more, more_temps = lower_grouped(
            graph, name, temps, (max(lo, gemm_from), ALL_M[1]), specialised
        )
        launches += more
        new_temps.update(more_temps)
    return launches, new_temps


MOE_LOWERINGS: dict[str, Callable[[Graph, str, Mapping[str, TensorType], Target], Lowered]] = {
    "route": lower_route,
    "expert_qlinear": lower_expert_qlinear,
}
