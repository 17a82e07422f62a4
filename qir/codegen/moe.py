"""Mixture-of-experts kernels: the router's top-k, the expert GEMVs (decode, small M) and the
grouped path (prefill, large M).

Stacked experts keep each format's buffers with a leading expert dim (qir.types.QExperts), so a
kernel reaches expert e by moving every buffer pointer by e experts' elements and then runs the
format's own fragment unchanged: every format works without a fragment of its own.

Decode (the GEMV family, qgemv.cu.j2 extended by moe_gemv.cu.j2):
- "slots" (gate/up with silu(g) * u, or any expert qlinear without a combine): expert-major,
  a block per (expert, row block). Each block reads the ids on the device, lists the (token,
  slot) pairs that chose its expert and runs them in tiles of m_tile rows: a chosen expert's
  weights are read once per m_tile pairs that chose it (once at decode), the others not at all,
  and the ids never go to the host. Output [M, k, N], a row per slot.
- "combine" (down with the router's weights and the residual): token-major, a block per (row
  block, m_tile tokens) sorts its tokens' pairs by expert, runs each chosen expert once for the
  tile, then sums each token's slots in slot order (no atomics: a token's bytes do not depend on
  the batch's other tokens).

With the rms_norm prologue (passes/norm_prologue: a MoE layer's post-attention norm) the slots
kernel reads rms_norm(x, nw): at M = 1 the dense GEMV's staged, normalised row; in tiles each
listed row's divisor summed by the block (qir_act_rows_norm), so the norm has no launch.

Prefill (the grouped path) is in qir/codegen/moe_gemm.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from qir.codegen.fragments import Fragment, fragment_for
from qir.codegen.gemv import (
    A4_MODES,
    GATE_ACTS,
    MIN_BLOCKS_PER_SM,
    PATHS,
    WARPS_PER_BLOCK,
    GemvSpec,
    lanes_suffix,
    norm_doc,
    norm_param,
    norm_suffix,
    target_suffix,
)
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.layer_kernels import c_float
from qir.codegen.render import common_header, render
from qir.dtypes import DType
from qir.moe import RULES
from qir.target import Target
from qir.types import QExperts

COMBINES = ("", "combine", "combine_residual")
# A block's static shared memory, and what an expert kernel's lists of rows and slots take of it.
STATIC_SMEM, LISTS_SMEM = 48 * 1024, 2 * 1024
_M = KernelParam("M", "int", "int")


def _buf(name: str, c_type: str, const: bool = True) -> KernelParam:
    return KernelParam(name, f"{'const ' if const else ''}{c_type}* __restrict__", "buffer")


def route_kernel(act: DType, experts: int, k: int, rule: str) -> Kernel:
    """ids and weights of router logits [M, experts] under `rule` (qir.moe): a warp per row."""
    if rule not in RULES or not 1 <= k <= experts:
        raise ValueError(f"route: rule {rule!r}, k {k} of {experts} experts")
    name = f"moe_route_{act.name}_e{experts}_top{k}_{rule}"
    desc = {
        "softmax_topk": "weights: their softmax probabilities over all experts.",
        "softmax_topk_norm": "weights: their softmax probabilities renormalised over the k.",
        "topk_softmax": "weights: the softmax of the k.",
        "sigmoid_topk": "weights: each one's sigmoid.",
    }[rule]
    source = render(
        "moe_route.cu.j2",
        name=name,
        act_t=act.c_type,
        experts=experts,
        top=k,
        rule=rule,
        rule_desc=desc,
    )
    params = (
        _buf("logits", act.c_type),
        _buf("ids", "int32_t", False),
        _buf("weights", "float", False),
        _M,
    )
    return Kernel(name, source, params, (32, 1, 1), (common_header(),))


def expert_strides(e: QExperts) -> dict[str, int]:
    """Elements of one expert in each stacked buffer: how far expert e's pointers move."""
    out = {}
    for name, t in e.expert_buffers().items():
        n = 1
        for d in t.shape:
            assert isinstance(d, int)
            n *= d
        out[name] = n
    return out


def row_bytes(e: QExperts) -> int:
    """Bytes of one output row of one expert: its buffers' per-row parts (a per-tensor scale,
    read once per block, not counted)."""
    total = 0
    for t in e.expert_buffers().values():
        if t.shape[0] == e.out_features:
            n = t.dtype.itemsize
            for d in t.shape[1:]:
                assert isinstance(d, int)
                n *= d
            total += n
    return total


@dataclass(frozen=True)
class ExpertGemvSpec:
    """One expert GEMV: `experts` (one stacked weight, or gate and up: silu(g) * u), k experts
    per token, and what it makes: a row per slot (combine "") or each token's combined row (with
    the residual for "combine_residual"). `per_slot`: the input holds a row per slot [M, k, K]
    (down reads gate/up's), else one per token. `count`: instrumented, for tests: each block
    adds the weight bytes it reads to reads[expert]. `target`: as GemvSpec's (E2M1 experts on a
    target with the FP4 conversion decode through it; the name says so)."""

    experts: tuple[QExperts, ...]
    act: DType
    m_tile: int
    top: int
    combine: str = ""
    per_slot: bool = False
    count: bool = False
    target: Target | None = None
    # the gate/up pair's activation: ("silu",), ("gelu_tanh",) or ("swiglu_clamp", limit, alpha)
    gate_act: tuple[Any, ...] = ("silu",)
    # The rms_norm prologue (the norm weight's dtype, eps): the rows read are rms_norm(x, nw).
    norm: tuple[DType, float] | None = None
    # W4A4 (NVFP4 experts): each slot's input quantized as it is read, under a per-row scale
    # ("dynamic") or its expert's calibrated one ("mul": ModelOpt's decode factor, "div":
    # compressed-tensors' encode factor; the act_scale parameter, the experts' input_scale
    # buffer [E, 1]). "": 16-bit activations.
    a4_mode: str = ""

    def __post_init__(self) -> None:
        if self.combine not in COMBINES:
            raise ValueError(f"unknown combine {self.combine!r}; known: {COMBINES}")
        if self.norm is not None and (self.combine or self.per_slot):
            raise ValueError("the rms_norm prologue takes a row per token and no combine")
        if self.norm is not None and self.a4_mode:
            # under W4A4 the norm belongs to the activation quantization (norm_prologue's rule)
            raise ValueError("the rms_norm prologue reads 16-bit activations, not W4A4's")
        if len({(e.count, e.format, e.in_features) for e in self.experts}) != 1:
            raise ValueError("one expert launch takes one expert count, format and in_features")
        if self.combine and len(self.experts) != 1:
            raise ValueError("the combine takes one stacked weight")
        if self.a4_mode not in ("", *A4_MODES):
            raise ValueError(f"unknown a4_mode {self.a4_mode!r}; known: {A4_MODES}")
        if not 1 <= self.top <= 32:
            # A decode step's slots are one ballot of a warp (moe_gemv.cu.j2).
            raise ValueError(f"top must be 1..32 experts per token, got {self.top}")
        _ = self.gemv  # the GEMV spec checks the rest (a gate/up pair of one shape, m_tile)

    @property
    def gemv(self) -> GemvSpec:
        epilogue = "silu_mul" if len(self.experts) == 2 else ""
        spec = GemvSpec(
            tuple(e.expert for e in self.experts),
            self.act,
            self.m_tile,
            epilogue=epilogue,
            target=self.target,
            a4=bool(self.a4_mode),
            crowded=len(self.experts) == 2,  # beside the ballot of a token's slots: Q6_K spilled
        )
        # The combine keeps a float per (tile row, slot, block row) in shared memory (the decode
        # path an act_t per (slot, block row)), every kind a tile's act_t results: short rows'
        # many rows a block get more lanes until those fit beside a staged row of x (2 K bytes)
        # and the tile's lists, in the 48 KB of static shared memory.
        per_row = 2 * self.m_tile + (
            4 * self.m_tile * self.top + 2 * self.top if self.combine else 0
        )
        # (W4A4 stages at most 2 K bytes of f16 pairs and K / 4 of block factors)
        k = self.experts[0].in_features
        budget = STATIC_SMEM - (2 * k + (k // 4 if self.a4_mode else 0)) - LISTS_SMEM
        rows = WARPS_PER_BLOCK * spec.rows_per_warp * 32
        lanes = spec.lanes
        while lanes < 32 and rows // lanes * per_row > budget:
            lanes *= 2
        return replace(spec, min_lanes=lanes)

    @property
    def kind(self) -> str:
        return "combine" if self.combine else "slots"

    @property
    def fragment(self) -> Fragment:
        w = self.experts[0].expert
        return fragment_for(w.format, w.out_features, w.in_features)

    @property
    def block_rows(self) -> int:
        return WARPS_PER_BLOCK * self.gemv.warp_rows

    @property
    def blocks_per_expert(self) -> int:
        return -(-self.experts[0].out_features // self.block_rows)

    @property
    def grid_x(self) -> int:
        per = self.blocks_per_expert
        return per * self.experts[0].count if self.kind == "slots" else per

    @property
    def name(self) -> str:
        e0 = self.experts[0]
        fused = act_tag(self.gate_act) if len(self.experts) == 2 else ""
        fused += "_bias" if self.experts[0].expert.bias else ""
        fused += {"": "", "combine": "_combine", "combine_residual": "_combine_res"}[self.combine]
        fused += norm_suffix(self.norm)
        fused += ("_slots_in" if self.per_slot else "") + ("_count" if self.count else "")
        fused += f"_a4{self.a4_mode}" if self.a4_mode else ""
        fused += target_suffix(self.target)
        return (
            f"moe_gemv_{e0.format.tag()}_{self.act.name}_e{e0.count}top{self.top}"
            f"_n{e0.out_features}_k{e0.in_features}_m{self.m_tile}"
            f"{lanes_suffix(self.gemv.lanes)}{fused}"
        )

    def params(self) -> list[KernelParam]:
        act = self.act.c_type
        weights = [
            param
            for j, e in enumerate(self.experts)
            for param in (
                *(
                    KernelParam(f"w{j}_{p.name.removeprefix('w_')}", p.c_type, "buffer")
                    for p in self.fragment.params
                ),
                *((_buf(f"w{j}_bias", "float"),) if e.expert.bias else ()),
            )
        ]
        scale = [_buf("act_scale", "float")] if self.a4_mode in ("mul", "div") else []
        router = [_buf("rw", "float")] if self.combine else []
        residual = [_buf("r", act)] if self.combine == "combine_residual" else []
        reads = [_buf("reads", "unsigned long long", False)] if self.count else []
        return [
            _buf("x", act),
            *((norm_param(self.norm),) if self.norm else ()),
            *weights,
            *scale,
            _buf("ids", "int32_t"),
            *router,
            *residual,
            _buf("y", act, False),
            *reads,
            _M,
        ]


def act_tag(act: tuple[Any, ...]) -> str:
    """The kernel-name part of a gate/up pair's activation."""
    if act[0] == "swiglu_clamp":
        return f"_swiglu{act[1]:g}a{act[2]:g}".replace(".", "p")
    return {"silu": "_silumul", "gelu_tanh": "_gelumul"}[act[0]]


def swiglu_consts(act: tuple[Any, ...]) -> tuple[str, str] | None:
    """The clamped SwiGLU's (limit, alpha) as C floats, or None for another activation."""
    return (c_float(act[1]), c_float(act[2])) if act[0] == "swiglu_clamp" else None


def expert_act(attrs: Mapping[str, Any]) -> tuple[Any, ...]:
    """An expert_qlinear's gate activation as the kernels' spec takes it."""
    act = attrs.get("act") or "silu"
    return (act, attrs["limit"], attrs["alpha"]) if act == "swiglu_clamp" else (act,)


def _a4_source(spec: ExpertGemvSpec, kind: str, source: str) -> str:
    """`source` (a `kind`), quantized as it is read for W4A4 experts, under expert e's input
    scale where the experts calibrated one (a per-row scale takes none)."""
    if not spec.a4_mode:
        return source
    scale = "act_scale[e]" if spec.a4_mode in ("mul", "div") else "0.0f"
    mode = A4_MODES.index(spec.a4_mode)
    return f"qir_act_quant_a4<{mode}, {kind}>{{{source}, {scale}}}"


def expert_gemv_kernel(spec: ExpertGemvSpec) -> Kernel:
    g, frag = spec.gemv, spec.fragment
    e0 = spec.experts[0]
    strides = expert_strides(e0)
    expert_weights = [
        "qir_row(qir_weight{"
        + ", ".join(f"w{j}_{b} + (size_t)e * {strides[b]}" for b in frag.buffers)
        + "}, b.base)"
        for j in range(len(spec.experts))
    ]
    expert_biases = [
        f"w{j}_bias + (size_t)e * {e0.out_features} + b.base" if w.expert.bias else "nullptr"
        for j, w in enumerate(spec.experts)
    ]
    # At M = 1 the slots kernel runs the whole expert (row 0 on), as a dense GEMV would.
    whole_weights = [w.replace(", b.base)", ", 0)") for w in expert_weights]
    whole_biases = [b.replace(" + b.base", "") for b in expert_biases]
    params = spec.params()
    x = "x[m, j]" if spec.per_slot else "x[m]"
    if spec.norm:
        x = norm_doc(spec.norm, None).replace("(x, nw)", "(x[m], nw)")
    plus = " + b_e" if e0.expert.bias else ""
    pair = f"{spec.gate_act[0]}({x} G_e^T{plus}) * ({x} U_e^T{plus})"
    if spec.gate_act[0] == "swiglu_clamp":
        limit, alpha = spec.gate_act[1:]
        pair = f"swiglu_gate({x} G_e^T{plus}) * swiglu_up({x} U_e^T{plus}), limit {limit}, alpha {alpha}"
    what = (
        (pair if len(spec.experts) == 2 else f"{x} W_e^T{plus}")
        + f", e = ids[m, j]; experts [{e0.count}, {e0.out_features}, {e0.in_features}] in {e0.format.spell()}"
    )
    if spec.a4_mode:
        what += f"; W4A4: {x} quantized to NVFP4 under " + (
            "a per-row scale" if spec.a4_mode == "dynamic" else "expert e's input scale"
        )
    header = [
        f"y[m, j] = {what}"
        if not spec.combine
        else f"y[m] = {'r[m] + ' if spec.combine == 'combine_residual' else ''}sum_j rw[m, j] * ({what})",
        f"{spec.kind}: {'a block per (expert, row block)' if spec.kind == 'slots' else 'a block per (row block, tile of tokens)'}",
    ]
    # where a tile's rows and the M = 1 row come from (qgemv.cu.j2, moe_gemv.cu.j2)
    if spec.norm:
        nw_t, eps = spec.norm[0].c_type, spec.norm[1]
        rows_source = f"qir_act_rows_norm<{nw_t}>{{x, rows, nw, {eps!r}, row_invs}}"
        row_source = f"qir_act_norm<{nw_t}>{{x, nw, {eps!r}}}"
    else:
        rows_source = "qir_act_rows{x, rows}"
        row_source = "qir_act_x{x" + (" + (size_t)j * QIR_K" if spec.per_slot else "") + "}"
    source = render(
        "moe_gemv.cu.j2",
        name=spec.name,
        header=header,
        fragment_template=frag.template,
        signature=[f"{p.c_type} {p.name}" for p in params],
        act_t=spec.act.c_type,
        K=e0.in_features,
        N=e0.out_features,
        top=spec.top,
        m_tile=spec.m_tile,
        weights_per_warp=len(spec.experts),
        rows_per_warp=g.rows_per_warp,
        lanes=g.lanes,
        shift_back=e0.out_features >= g.rows_per_warp,
        warps=WARPS_PER_BLOCK,
        min_blocks=MIN_BLOCKS_PER_SM,
        chunks_per_row=frag.chunks_per_row(e0.in_features),
        path=PATHS.index(g.path(frag)),
        int_path=False,
        epilogue=2 if len(spec.experts) == 2 else 0,
        gate_fn=GATE_ACTS.get(spec.gate_act[0], ""),
        swiglu=swiglu_consts(spec.gate_act),
        expert_biases=expert_biases,
        cap="1.0f",  # no softcap epilogue here
        kind=spec.kind,
        blocks_per_expert=spec.blocks_per_expert,
        expert_weights=expert_weights,
        whole_weights=whole_weights,
        whole_biases=whole_biases,
        per_slot=spec.per_slot,
        norm=spec.norm is not None,
        # where a tile's rows and the M = 1 row come from (qgemv.cu.j2, moe_gemv.cu.j2)
        rows_source=_a4_source(spec, "qir_act_rows", rows_source),
        row_source=_a4_source(spec, "qir_act_x", row_source),
        residual=spec.combine == "combine_residual",
        count=spec.count,
        row_bytes=row_bytes(e0) * len(spec.experts),
        has_bias=e0.expert.bias,
        stage_f32=0,  # its sources stage their own rows (qir_act_rows)
        target=spec.target.arch if spec.target else "",
        fp4_cvt=bool(spec.target and spec.target.fp4_cvt),
        a4=bool(spec.a4_mode),
        **frag.context,
    )
    return Kernel(
        spec.name, source, tuple(params), (32 * WARPS_PER_BLOCK, 1, 1), (common_header(),)
    )
