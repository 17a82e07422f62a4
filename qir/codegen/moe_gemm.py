"""The grouped path of the expert qlinear (prefill, large M), all on the device:

1. moe_group (one block, once per router's ids): the (token, slot) pairs counted per expert,
   the counts scanned into offsets, and each expert's pairs listed in pair order (no float
   atomics, no host round trip: the lists are the same whatever order the threads ran in).
2. a grouped GEMM per expert qlinear (qgemm.cu.j2 extended by moe_gemm.cu.j2): grid.y holds
   every expert's tiles of BM pairs in turn (ceil(M k / BM) + E blocks: each expert wastes less
   than a tile; blocks past the last tile return); a block finds its expert and pairs from the
   offsets, gathers their rows of x by cp.async, moves the weight pointers to its expert and
   runs the GEMM's own pipeline, storing row p = m k + j of the per-slot result.
3. for a combine, moe_combine: each token's slots summed in slot order (qir.moe.combine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qir.codegen.expert_args import expert_weight_args, input_args, norm_of
from qir.codegen.fragments import fragment_for
from qir.codegen.gemm import GemmSpec, GroupedGemm, bucket_ranges, gemm_kernel, pair_value
from qir.codegen.gemv import GATE_ACTS, norm_doc, norm_param, target_suffix
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.moe import act_tag, expert_act, expert_strides, swiglu_consts
from qir.codegen.plan import Arg, Launch
from qir.codegen.render import common_header, render
from qir.dtypes import I32, DType
from qir.graph import Graph
from qir.ops import layout
from qir.target import Target
from qir.types import QExperts, TensorType

GROUP_THREADS = 256
COMBINE_THREADS = 128
_M = KernelParam("M", "int", "int")

Lowered = tuple[list[Launch], dict[str, TensorType]]


def _buf(name: str, c_type: str, const: bool = True) -> KernelParam:
    return KernelParam(name, f"{'const ' if const else ''}{c_type}* __restrict__", "buffer")


def group_kernel(experts: int, top: int) -> Kernel:
    name = f"moe_group_e{experts}_top{top}"
    source = render("moe_group.cu.j2", name=name, experts=experts, top=top, threads=GROUP_THREADS)
    params = (
        _buf("ids", "int32_t"),
        _buf("order", "int32_t", False),
        _buf("offsets", "int32_t", False),
        _M,
    )
    return Kernel(name, source, params, (GROUP_THREADS, 1, 1), (common_header(),))


def combine_kernel(act: DType, top: int, n: int, residual: bool) -> Kernel:
    name = f"moe_combine_{act.name}_top{top}_n{n}" + ("_res" if residual else "")
    source = render(
        "moe_combine.cu.j2",
        name=name,
        act_t=act.c_type,
        top=top,
        N=n,
        residual=residual,
        threads=COMBINE_THREADS,
    )
    params = (
        _buf("ys", act.c_type),
        _buf("rw", "float"),
        *((_buf("r", act.c_type),) if residual else ()),
        _buf("y", act.c_type, False),
        _M,
    )
    return Kernel(
        name, source, params, (COMBINE_THREADS, 1, 1), (common_header(),), collectives=False
    )


def grouped_gemm(
    experts: tuple[QExperts, ...],
    act: DType,
    m_max: int,
    top: int,
    per_slot: bool,
    gate_act: tuple[Any, ...] = ("silu",),
    target: Target | None = None,
    norm: tuple[DType, float] | None = None,
) -> tuple[Kernel, GemmSpec]:
    """The grouped GEMM of `experts` (one, or gate and up: act(g) * u, `gate_act` as
    qir.codegen.moe.ExpertGemvSpec's) for the tile bucket ending at m_max rows, and the
    GemmSpec whose tile and pipeline it runs (specialised for `target` as GemmSpec.target says).
    Biased experts add expert e's bias to its sums. `norm` (the norm weight's dtype, eps): the
    rms_norm prologue, the dense GEMM's on the gathered rows (each tile's rows' divisors first,
    then the normalised tiles)."""
    e0 = experts[0]
    paired = len(experts) == 2
    if norm is not None and per_slot:
        raise ValueError("the rms_norm prologue takes a row per token")
    spec = GemmSpec(
        tuple(e.expert for e in experts),
        act,
        m_max,
        epilogue="silu_mul" if paired else "",
        target=target,
        # the clamped SwiGLU replaces the gate function (the swiglu context below)
        gate_act="silu" if gate_act[0] == "swiglu_clamp" else gate_act[0],
        norm=norm,
    )
    bias = e0.expert.bias
    frag = fragment_for(e0.format, e0.out_features, e0.in_features)
    suffixes = [p.name.removeprefix("w_") for p in frag.params]
    strides = expert_strides(e0)
    pointers = [
        f"{p.c_type} ew{j}_{s} = w{j}_{s} + (size_t)e * {strides[s]};"
        for j in range(len(experts))
        for p, s in zip(frag.params, suffixes, strict=True)
    ]
    if bias:
        pointers += [
            f"const float* __restrict__ ew{j}_bias = w{j}_bias + (size_t)e * {e0.out_features};"
            for j in range(len(experts))
        ]
    b_args = ", ".join(
        f"(row & 8) ? ew1_{s} : ew0_{s}" if len(experts) == 2 else f"ew0_{s}" for s in suffixes
    )
    # the GEMM's name says silumul for its pair: the clamped SwiGLU spells itself instead
    suffix = target_suffix(target)  # last, as in every specialised kernel's name
    base = spec.name.removesuffix(suffix)
    base = base.replace("_silumul", act_tag(gate_act)) if paired else base
    name = f"moe_{base}_e{e0.count}top{top}" + ("_slots_in" if per_slot else "") + suffix
    params = (
        _buf("x", act.c_type),
        *((norm_param(norm),) if norm else ()),
        *(
            param
            for j in range(len(experts))
            for param in (
                *(
                    KernelParam(f"w{j}_{s}", p.c_type, "buffer")
                    for p, s in zip(frag.params, suffixes, strict=True)
                ),
                *((_buf(f"w{j}_bias", "float"),) if bias else ()),
            )
        ),
        _buf("order", "int32_t"),
        _buf("offsets", "int32_t"),
        _buf("y0", act.c_type, False),
        _M,
    )
    plus = " + b_e" if bias else ""
    x = norm_doc(norm, None) if norm else "x"
    what = f"{gate_act[0]}({x} G_e^T{plus}) * ({x} U_e^T{plus})" if paired else f"{x} W_e^T{plus}"
    # The tile's rows are those its pairs gathered (-1: no pair), not m0 on.
    rows = {"row_of": "qir_rows[row]", "row_in": "m >= 0"}
    loader = (
        render("gemm/a_norm.cuh.j2", **rows) if norm else render("gemm/a_gather.cuh.j2")
    ).rstrip("\n")
    doc = [
        f"Grouped: y[p] = {what} for each (token, slot) pair p of expert e (moe_group's lists);",
        f"experts [{e0.count}, {e0.out_features}, {e0.in_features}] in {e0.format.spell()}, {top} per token.",
    ]
    grouped = GroupedGemm(
        "moe_gemm.cu.j2",
        name,
        params,
        {
            "experts": e0.count,
            "top": top,
            "per_slot": per_slot,
            "expert_pointers": pointers,
            "select": [],
            "b_args": b_args,
            "a_loader": loader,
            **(
                {
                    "row_scale": render(
                        "gemm/row_norm.cuh.j2",
                        eps=repr(norm[1]),
                        res_eps=None,
                        stores_h=False,
                        **rows,
                    )
                }
                if norm
                else {}
            ),
            "doc": "\n".join(f"// {line}" for line in doc),
            "pair_value": pair_value(GATE_ACTS.get(gate_act[0], ""), swiglu_consts(gate_act)),
            # expert e's biases join the float sums (the pointers above)
            "g_value": "acc[mt][nt][i]" + (" + ew0_bias[n]" if bias else ""),
            "u_value": "acc[mt][nt + 1][i]" + (" + ew1_bias[n]" if bias and paired else ""),
        },
    )
    return gemm_kernel(spec, grouped), spec


def lower_grouped(
    graph: Graph,
    name: str,
    temps: Mapping[str, TensorType],
    when: tuple[int, int],
    target: Target | None = None,
) -> Lowered:
    """The grouped path of expert_qlinear `name` for batch sizes `when`: the grouping of its
    ids (unless an earlier expert launch of the same ids and range made it: see `temps`), a
    grouped GEMM per tile bucket and, for a combine, the combine."""
    node = graph.node(name)
    operands = graph.operands(name)
    types = [graph.node(o).type for o in operands]
    segments = layout(graph, name)
    ws, at = segments["weights"], segments["ids"].start
    experts = tuple(t for t in types[ws] if isinstance(t, QExperts))
    ids = operands[at]
    ids_t, x_t, out_t = (graph.node(v).type for v in (ids, operands[0], name))
    assert isinstance(ids_t, TensorType) and isinstance(x_t, TensorType)
    assert isinstance(out_t, TensorType)
    top = ids_t.shape[1]
    assert isinstance(top, int)
    count, n = experts[0].count, experts[0].out_features
    launches: list[Launch] = []
    new: dict[str, TensorType] = {}
    order, offsets = f"{ids}.order_m{when[0]}", f"{ids}.offsets_m{when[0]}"
    if order not in temps:
        new[order] = TensorType(("M", top), I32)
        new[offsets] = TensorType((count + 1,), I32)
        launches.append(
            Launch(
                group_kernel(count, top),
                1,
                1,
                (Arg("value", ids), Arg("value", order), Arg("value", offsets), Arg("M")),
                (order, offsets),
                (name,),
                when,
                rows_per_m=0,
                extra_y=1,
            )
        )
    combine = node.attr("epilogue") in ("combine", "combine_residual")
    slots = graph.fresh(f"{name}.slots") if combine else name
    if combine:
        new[slots] = TensorType(("M", top, n), out_t.dtype)
    frag_buffers = fragment_for(experts[0].format, n, experts[0].in_features).buffers
    for bucket in bucket_ranges(*when):
        kernel, spec = grouped_gemm(
            experts,
            out_t.dtype,
            bucket[1],
            top,
            x_t.rank == 3,
            expert_act(dict(node.attrs)),
            target,
            norm_of(graph, name),
        )
        args = (
            *input_args(graph, name),
            *expert_weight_args(operands[ws], experts, frag_buffers),
            Arg("value", order),
            Arg("value", offsets),
            Arg("value", slots),
            Arg("M"),
        )
        launches.append(
            Launch(
                kernel,
                spec.grid_x,
                spec.tile.bm,
                args,
                (slots,),
                (name, *node.attr("fused", ())),
                bucket,
                rows_per_m=top,
                extra_y=count,
            )
        )
    if combine:
        residual = node.attr("epilogue") == "combine_residual"
        args = (
            Arg("value", slots),
            *(Arg("value", v) for v in operands[at + 1 :]),
            Arg("value", name),
            Arg("M"),
        )
        kernel = combine_kernel(out_t.dtype, top, n, residual)
        launches.append(Launch(kernel, 1, 1, args, (name,), (name,), when))
    return launches, new
