"""The tensor-core GEMM family: prefill and batched serving (the GEMV family serves small M).

One template (templates/qgemm.cu.j2) covers every format and fusion the GEMV does: a block
computes a BM x BN tile of y = x W^T with `mma.sync` m16n8k16 (f16 or bf16 operands, fp32
accumulation) on fragments loaded by `ldmatrix` from shared memory. The activation tile arrives
by a multi-stage `cp.async` pipeline (or is computed while it is staged: the silu(g) * u
prologue; decoded: W4A4's pre-quantized input); the weight tile is decoded into shared memory
by the format's own fragment (`qir_decode`: the k-order pairs of the activation type the GEMV's
pair path builds on), so a format stays one module. Each thread handles a fixed set of tile
rows, so the compiler keeps their addresses in registers across the K loop. Several weights
sharing the input (q/k/v) take consecutive ranges of grid.x, each with its own scales; gate/up
are interleaved by 8 rows in one tile so silu(g) * u is the epilogue. Weights of several
formats (a GGUF's Q4_K q/k and Q6_K v) share one launch too: each format's fragment sits in a
namespace of its own, and a block decodes its weight's tiles with its format's (a block serves
one weight, so the choice is uniform over it).

Numerics: the tensor cores multiply 16-bit operands. A weight's code becomes an exact integer
(or small float) in the activation type, its scale (and MLX's bias) is rounded to that type,
and the product rounds once; products in the MMA are exact and sums fp32. W4A4 loses nothing:
E2M1 values are exact in both types.

Python decides every constant here (the tile from `GEMM_TILES`, the pipeline depth from the
shared-memory budget, the loaders, the argument expressions); the template only substitutes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from qir.codegen.fragments import Fragment, fragment_for
from qir.codegen.gemv import (
    EPILOGUES,
    GATE_ACTS,
    GemvSpec,
    bias_of,
    c_cap,
    cap_suffix,
    gate_spelled,
    h_param,
    norm_doc,
    norm_params,
    norm_suffix,
    segments,
    target_suffix,
    weight_params,
)
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import TEMPLATES, common_header, render
from qir.dtypes import BF16, F16, DType
from qir.target import Target
from qir.types import QWeight

MMA_HEADER = "qir_mma.cuh"
GEMM_HEADER = "qir_gemm.cuh"
# Static shared memory a block may declare (CUDA's limit without opting in to more).
SMEM_BYTES = 48 * 1024
# Halves of padding after each shared-memory row: rows (BK + 8) * 2 bytes apart put the 8 rows
# an ldmatrix reads in 8 different 16-byte bank groups, and keep every row 16-byte aligned.
ROW_PAD = 8
MAX_M = 2**31 - 1
# The GEMM's operand types: f32 activations stay on the GEMV family.
ACTS = (F16, BF16)


@dataclass(frozen=True)
class Tile:
    """A block's BM x BN output tile, its K step, its warps (warps_m x warps_n, each owning a
    (BM / warps_m) x (BN / warps_n) sub-tile of m16n8 MMAs), the pipeline depth it starts from
    (lowered while shared memory does not fit) and the resident blocks per SM it asks for."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    min_blocks: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def mt(self) -> int:
        return self.bm // self.warps_m // 16

    @property
    def nt(self) -> int:
        return self.bn // self.warps_n // 8

    @property
    def spell(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}s{self.stages}w{self.warps_m}x{self.warps_n}"


# The one tile table: (largest M, smallest N, tile); the first row whose M bound is at least
# the bucket's largest M and whose N bound the weight's out_features reach is taken. Defaults
# sized by reasoning, not yet by measurements (benchmarks/llama_shapes.py sweeps M on a GPU):
# up to 64 rows the weights dominate, so tiles are narrow in N (more blocks to stream them); past
# that, 128 x 128 tiles of 8 warps reuse each dequantized weight tile over 128 rows, two blocks
# resident (128 registers a thread: the main loop keeps each thread's tile addresses, 124-128
# registers for the formats' decodes, none spilled). W4A4 runs only up to 64 rows (W4A4_MAX_M),
# inside the first bucket.
GEMM_TILES: tuple[tuple[int, int, Tile], ...] = (
    (64, 4096, Tile(64, 64, 32, 2, 2, stages=3, min_blocks=2)),
    (64, 0, Tile(64, 32, 32, 4, 1, stages=3, min_blocks=2)),
    (MAX_M, 4096, Tile(128, 128, 32, 2, 4, stages=3, min_blocks=2)),
    (MAX_M, 0, Tile(128, 64, 32, 2, 2, stages=3, min_blocks=1)),
)
# The M buckets the table distinguishes: a GEMM node gets one launch per bucket it serves.
M_BUCKETS: tuple[int, ...] = tuple(sorted({m for m, _, _ in GEMM_TILES}))


def bucket_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi] cut at the table's M buckets."""
    out, start = [], lo
    for bound in M_BUCKETS:
        if start > hi:
            break
        if bound >= start:
            out.append((start, min(bound, hi)))
            start = bound + 1
    return out


@dataclass(frozen=True)
class GroupedGemm:
    """How a grouped GEMM's kernel differs from its GemmSpec's: the template extending
    qgemm.cu.j2, its name, parameters and the template's variables (overriding the GEMM's)."""

    template: str
    name: str
    params: tuple[KernelParam, ...]
    context: Mapping[str, Any]


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM kernel: the fused form (as the GEMV family's spec has it: several weights, the
    SiLU-gate prologue, the residual or silu_mul epilogue, W4A4) and the largest M of the tile
    bucket it serves."""

    weights: tuple[QWeight, ...]
    act: DType
    m_max: int
    prologue: bool = False
    epilogue: str = ""
    a4: bool = False
    a4_mode: str = "dynamic"
    # W4A4 on Blackwell's block-scaled FP4 MMA (sm_120a/sm_121a; the host runs its emulation):
    # the kernel reads the 16-bit input and quantizes it as quantize_act (mode a4_mode) would.
    native: bool = False
    norm: tuple[DType, float] | None = None  # input = rms_norm(x, nw), as GemvSpec.norm
    # As GemvSpec.target; a native GEMM is specialised for its target (sm_120a/sm_121a).
    target: Target | None = None
    gate_act: str = "silu"  # as GemvSpec.gate_act
    cap: float | None = None  # as GemvSpec.cap
    res_norm: tuple[DType, float, bool] | None = None  # as GemvSpec.res_norm

    def __post_init__(self) -> None:
        if self.act not in ACTS:
            raise ValueError(f"the GEMM family takes f16 or bf16 activations, not {self.act.name}")
        _ = self.fused  # the GEMV spec checks the fused form
        if self.native and (not self.a4 or self.prologue):
            raise ValueError("the block-scaled FP4 GEMM takes W4A4 without a prologue")
        if self.native and not (self.target and self.target.block_scaled_fp4_mma):
            raise ValueError("the block-scaled FP4 GEMM needs a target with its MMA (sm_120a)")

    @classmethod
    def of(cls, fused: GemvSpec, m_max: int) -> GemmSpec:
        """The GEMM of the fused form `fused` describes (its m_tile is the GEMV's own)."""
        return cls(
            fused.weights,
            fused.act,
            m_max,
            fused.prologue,
            fused.epilogue,
            fused.a4,
            fused.a4_mode,
            norm=fused.norm,
            target=fused.target,
            gate_act=fused.gate_act,
            cap=fused.cap,
            res_norm=fused.res_norm,
        )

    @property
    def fused(self) -> GemvSpec:
        return GemvSpec(
            self.weights,
            self.act,
            1,
            self.prologue,
            self.epilogue,
            self.a4,
            self.a4_mode,
            self.norm,
            self.target,
            self.gate_act,
            self.cap,
            self.res_norm,
        )

    @property
    def paired(self) -> bool:
        return self.epilogue == "silu_mul"

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        """Each format's fragment, in the order the formats first appear."""
        return self.fused.fragments

    @property
    def chunk(self) -> int:
        """The widest fragment chunk: a K step holds whole chunks of every format (chunks are
        powers of two)."""
        return max(f.chunk_elems for f in self.fragments)

    @property
    def tile(self) -> Tile:
        gathers = any(f.context.get("gathers") for f in self.fragments)
        n = max(w.out_features for w in self.weights)
        return choose_tile(self.m_max, n, self.chunk, self.a4, self.native, gathers)

    @property
    def name(self) -> str:
        f = self
        w0 = f.weights[0]
        outs = segments(f.weights)
        fused = ("_silu" if f.prologue else "") + norm_suffix(f.norm, f.res_norm)
        fused += EPILOGUES[f.epilogue]
        fused += cap_suffix(f.cap)
        if f.a4:
            fused += "_a4" + (f.a4_mode if f.prologue or f.native else "")
        if f.native:
            fused += "_nvf4"
        fused = gate_spelled(fused + target_suffix(f.target), f.gate_act)
        # every format, in the order of first appearance (segments say whose rows come where)
        tags = "_".join(dict.fromkeys(w.format.tag() for w in f.weights))
        return f"qgemm_{tags}_{self.act.name}_n{outs}_k{w0.in_features}_{self.tile.spell}{fused}"

    def tiles(self, w: QWeight) -> int:
        """Blocks along N that serve weight `w` (a pair's blocks serve both)."""
        bn = self.tile.bn // 2 if self.paired else self.tile.bn
        return -(-w.out_features // bn)

    @property
    def grid_x(self) -> int:
        if self.paired:
            return self.tiles(self.weights[0])
        return sum(self.tiles(w) for w in self.weights)


def smem_bytes(tile: Tile, stages: int, a4: bool, native: bool = False) -> int:
    """Static shared memory of a kernel: per stage the two tiles (and W4A4's block factors),
    plus W4A4's per-row scales. The block-scaled FP4 tiles hold packed codes (rows padded by 4
    words) and a byte per block."""
    rows = tile.bm + tile.bn
    if native:
        return stages * rows * ((tile.bk // 8 + 4) * 4 + tile.bk // 16) + tile.bm * 4
    tiles = rows * (tile.bk + ROW_PAD) * 2
    factors = rows * (tile.bk // 16) * 4 if a4 else 0
    return stages * (tiles + factors) + (tile.bm * 4 if a4 else 0)


@cache
def choose_tile(
    m_max: int, n: int, chunk: int, a4: bool, native: bool = False, gathers: bool = False
) -> Tile:
    """The table's tile for a bucket ending at `m_max` and `n` output rows. BK grows to the
    fragment's chunk (a chunk never straddles two K steps; the block-scaled FP4 MMA takes K in
    64s); then, until shared memory fits, the stages drop to 2, BN halves (keeping an even
    number of n8 tiles per warp), then BM. A fragment that gathers per weight (GPTQ act-order)
    asks for one resident block: its decode needs more registers than two blocks leave."""
    t = next(t for m, n_min, t in GEMM_TILES if m_max <= m and n >= n_min)
    bm, bn, bk, stages = t.bm, t.bn, max(t.bk, chunk, 64 if native else 16), t.stages
    min_blocks = 1 if gathers else t.min_blocks

    def tile() -> Tile:
        return Tile(bm, bn, bk, t.warps_m, t.warps_n, stages, min_blocks)

    while smem_bytes(tile(), stages, a4, native) > SMEM_BYTES:
        if stages > 2:
            stages -= 1
        elif bn // t.warps_n > 16:
            bn //= 2
        elif bm // t.warps_m > 16:
            bm //= 2
        else:
            raise ValueError(f"no GEMM tile from {t} fits {SMEM_BYTES} bytes of shared memory")
    return tile()


@cache
def mma_header() -> tuple[str, str]:
    """The mma / ldmatrix / cp.async helpers, as a (file name, text) header."""
    return MMA_HEADER, (TEMPLATES / MMA_HEADER).read_text()


@cache
def gemm_header() -> tuple[str, str]:
    """What GEMM kernels share besides the helpers (stores, decodes, the row scale)."""
    return GEMM_HEADER, (TEMPLATES / GEMM_HEADER).read_text()


def _variant(f: GemmSpec) -> dict[str, str]:
    """The templates of what differs between the GEMM's kinds: the activation loader, the weight
    adapter, the shared memory, the MMA step, and where the weight chunk goes."""
    if f.native:
        return {
            "a_loader": "gemm/a_nvfp4_native.cuh.j2",
            "b_adapter": "gemm/b_nvfp4_native.cuh.j2",
            "smem": "gemm/smem_nvf4.cuh.j2",
            "mma": "gemm/mma_nvf4.cuh.j2",
            "b_tile": "&Bc[stage][row][c * CHUNK / 8]",
            "b_scales": "&Bsf[stage][row][c * BPC]",
        }
    if f.a4:
        loader = "gemm/a_silu_nvfp4.cuh.j2" if f.prologue else "gemm/a_nvfp4.cuh.j2"
        return {
            "a_loader": loader,
            "b_adapter": "gemm/b_nvfp4_codes.cuh.j2",
            "smem": "gemm/smem_a4.cuh.j2",
            "mma": "gemm/mma_a4.cuh.j2",
            "b_tile": "&Bs[stage][row][c * CHUNK]",
            "b_scales": "&Bf[stage][row][c * BPC]",
        }
    loader = "gemm/a_cp_async.cuh.j2"
    if f.norm:
        loader = "gemm/a_res_norm.cuh.j2" if f.res_norm else "gemm/a_norm.cuh.j2"
    return {
        "a_loader": "gemm/a_silu.cuh.j2" if f.prologue else loader,
        "b_adapter": "gemm/b_dequant.cuh.j2",
        "smem": "gemm/smem_mma.cuh.j2",
        "mma": "gemm/mma_16.cuh.j2",
        "b_tile": "&Bs[stage][row][c * CHUNK]",
        "b_scales": "nullptr",
    }


def _b_tile(ctx: dict[str, Any], ns: str, args: str, half: int | None) -> str:
    """One weight's part of load_b: its chunks of the tile's rows (of a pair's tile: the gate's
    rows 16i..16i+7 when half is 0, the up's 16i+8..16i+15 when 1; all rows when None)."""
    if half is None:
        n = "(row >> 4) * 8 + (row & 7)" if ctx["paired"] else "row"
        rows = [
            "      const int row = i / CPT, c = i % CPT;",
            f"      const int n = n0 + {n}, chunk = kt * CPT + c;",
        ]
    else:
        rows = [
            f"      // this weight's rows of the pair's tile: {'up' if half else 'gate'} rows "
            f"16i + {8 * half}..16i + {8 * half + 7}",
            f"      const int h = i / CPT, c = i % CPT, row = (h >> 3) * 16 + {8 * half} + (h & 7);",
            "      const int n = n0 + h, chunk = kt * CPT + c;",
        ]
    return render(
        "gemm/b_tile.cuh.j2",
        slots="BN * CPT" if half is None else "BN / 2 * CPT",
        rows="\n".join(rows),
        ns=ns,
        args=args,
        b_tile=ctx["b_tile"],
        b_scales=ctx["b_scales"],
    )


def _b_loader(ctx: dict[str, Any]) -> str:
    """load_b's body: the weight tile's decode by one fragment, or (weights of several formats)
    each format's part by its own, chosen by the block's segment (a pair: both, one after the
    other)."""
    if not ctx["mixed"]:
        return _b_tile(ctx, "", ctx["b_args"], None).rstrip("\n")
    which = "gate's rows, then up's" if ctx["paired"] else "a block serves one weight"
    lines = [f"    // Each format's weights decoded by its own fragment ({which})."]
    for i, p in enumerate(ctx["b_parts"]):
        lines.append(f"    {'if (' + p['cond'] + ') ' if p['cond'] else ''}{{  // {p['format']}")
        lines.append(
            f"      constexpr int CHUNK = {p['chunk']}, CPT = BK / CHUNK, "
            f"CHUNKS = {p['chunks_per_row']};"
        )
        tile = _b_tile(ctx, p["ns"], p["args"], i if ctx["paired"] else None)
        lines += [f"  {line}" if line else line for line in tile.rstrip("\n").split("\n")]
        if p["cond"]:
            lines.append("      return;")
        lines.append("    }")
    return "\n".join(lines)


def gemm_kernel(spec: GemmSpec, grouped: GroupedGemm | None = None) -> Kernel:
    """The kernel of `spec`; `grouped`: rendered as a grouped GEMM instead (qir.codegen.moe_gemm:
    its template extends this one, with its own name, parameters and variables)."""
    f, tile = spec, spec.tile
    w0 = f.weights[0]
    frag = fragment_for(w0.format, w0.out_features, w0.in_features)
    act_t = f.act.c_type
    suffixes = [p.name.removeprefix("w_") for p in frag.params]
    # Segments: weight j takes blocks [start, start + tiles(w)) of grid.x.
    segments, start = [], 0
    for j, w in enumerate(f.weights):
        segments.append({"j": j, "N": w.out_features, "start": start})
        start += spec.tiles(w)
    if f.paired or len(f.weights) == 1:
        select = {s: f"w0_{s}" for s in suffixes}
        # A pair's tile interleaves gate (rows 8i..8i+7 of each 16) and up (the next 8).
        b_args = ", ".join(
            f"(row & 8) ? w1_{s} : w0_{s}" if f.paired else f"w0_{s}" for s in suffixes
        )
    else:
        select = {}
        for s in suffixes:
            expr = f"w{len(f.weights) - 1}_{s}"
            for seg in reversed(segments[:-1]):
                expr = f"seg == {seg['j']} ? w{seg['j']}_{s} : {expr}"
            select[s] = expr
        b_args = ", ".join(f"sel_{s}" for s in suffixes)
    # The weight tile's decode: one fragment, or (weights of several formats) one per format,
    # each in a namespace of its own and chosen by the block's segment.
    preamble = [render(frag.template, **frag.context)]
    mixed = f.fused.mixed
    b_parts: list[dict[str, object]] = []
    select_list: list[dict[str, str]] = []
    if mixed:
        preamble, b_parts = [], []
        by_format: dict[object, list[int]] = {}
        for j, w in enumerate(f.weights):
            by_format.setdefault(w.format, []).append(j)
        for i, js in enumerate(by_format.values()):
            w = f.weights[js[0]]
            pf = fragment_for(w.format, w.out_features, w.in_features)
            ns = f"qir_part{i}"
            part_suffixes = [p.name.removeprefix("w_") for p in pf.params]
            for p, s in zip(pf.params, part_suffixes, strict=True):
                expr = f"w{js[-1]}_{s}"
                for j in reversed(js[:-1]):
                    expr = f"seg == {j} ? w{j}_{s} : {expr}"
                select_list.append({"c_type": p.c_type, "suffix": f"{i}_{s}", "expr": expr})
            decode = render(pf.template, **pf.context) + render(
                "gemm/b_dequant.cuh.j2", chunk=pf.chunk_elems
            )
            preamble.append(f"namespace {ns} {{\n{decode}}}  // namespace {ns}")
            b_parts.append(
                {
                    "ns": f"{ns}::",
                    # a pair's parts each decode their own rows of every tile
                    "cond": "" if f.paired else " || ".join(f"seg == {j}" for j in js),
                    "format": w.format.spell(),
                    "chunk": pf.chunk_elems,
                    "chunks_per_row": pf.chunks_per_row(w0.in_features),
                    "args": ", ".join(f"sel_{i}_{s}" for s in part_suffixes),
                }
            )
        b_parts[-1]["cond"] = ""  # the last format's blocks are the rest
    params = _params(spec, frag)
    # Biases join the float sums before anything rounds: the gate's and the up's in a pair, a
    # multi-weight launch's segment's (chosen per block, null for a segment without).
    g_value, u_value, bias_decl = "acc[mt][nt][i]", "acc[mt][nt + 1][i]", ""
    if f.paired or len(f.weights) == 1:
        if f.weights[0].bias:
            g_value += " + w0_bias[n]"
        if f.paired and f.weights[1].bias:
            u_value += " + w1_bias[n]"
    elif any(w.bias for w in f.weights):
        expr = f"(const float*){bias_of(f.weights, len(f.weights) - 1)}"
        for seg in reversed(segments[:-1]):
            expr = f"seg == {seg['j']} ? (const float*){bias_of(f.weights, seg['j'])} : {expr}"
        bias_decl = f"  const float* __restrict__ bias = {expr};"
        g_value += " + (bias != nullptr ? bias[n] : 0.0f)"
    # Pieces rendered here from their own templates (the fragment with its context), so the
    # kernel template only places them.
    v = _variant(f)
    scale = "*act_scale" if f.a4_mode != "dynamic" else "row_scale[row]"
    # The GEMM's own names come after the fragment's context: a fragment's keys (its "scale"
    # kind, say) must not replace them.
    parts = {
        **frag.context,
        "chunk": frag.chunk_elems,
        "row_bytes": w0.in_features // 2 + 4 * (w0.in_features // 16),
        "a4_mode": f.a4_mode,
        "act_mode": 1 if f.a4_mode == "mul" else 0,
        "act_scale": scale,
        "paired": f.paired,
        "gate_fn": GATE_ACTS[f.gate_act],
    }
    if f.a4 and (f.prologue or f.native):
        preamble.append(render("formats/nvfp4_quant.cuh"))
    if not mixed:
        preamble.append(render(v["b_adapter"], **parts))
    row_scale = ""
    if f.a4 and f.a4_mode == "dynamic" and (f.prologue or f.native):
        row_scale = render(
            "gemm/row_scale.cuh.j2" if f.prologue else "gemm/row_scale_x.cuh.j2", **parts
        )
    if f.norm:
        res_eps = repr(f.res_norm[1]) if f.res_norm else None
        stores_h = bool(f.res_norm and f.res_norm[2])
        row_scale = render(
            "gemm/row_norm.cuh.j2", eps=repr(f.norm[1]), res_eps=res_eps, stores_h=stores_h
        )
    finish = ""
    if f.native:
        # The row's activation factor is s / scale (mode 0) or s * scale (mode 1), the weight's
        # s / g or s * g (its scale_op): the MMA took each s, these take the rest.
        row_factor = f"(1.0f / {scale})" if parts["act_mode"] == 0 else scale
        globals_ = ["w0_global_scale", "w1_global_scale"] if f.paired else ["sel_global_scale"] * 2
        op = frag.context["scale_op"]
        w_factors = ", ".join(f"(*{g})" if op == "*" else f"(1.0f / *{g})" for g in globals_)
        finish = render(
            "gemm/finish_nvf4.cuh.j2", row_factor=row_factor, w_factors=w_factors, paired=f.paired
        )
    name, template = spec.name, "qgemm.cu.j2"
    if grouped is not None:
        name, template, params = grouped.name, grouped.template, list(grouped.params)
    context: dict[str, Any] = dict(
        name=name,
        doc="\n".join(f"// {line}" for line in _doc(spec)),
        preamble="\n".join(preamble),
        a_loader=render(v["a_loader"], **parts).rstrip("\n"),
        row_scale=row_scale.rstrip("\n"),
        smem=render(v["smem"]).rstrip("\n"),
        mma=render(v["mma"]).rstrip("\n"),
        finish=finish.rstrip("\n"),
        b_tile=v["b_tile"],
        b_scales=v["b_scales"],
        signature=",\n    ".join(f"{p.c_type} {p.name}" for p in params),
        act_t=act_t,
        tile=tile,
        K=w0.in_features,
        chunk=frag.chunk_elems,
        chunks_per_row=frag.chunks_per_row(w0.in_features),
        segments=segments,
        select=select_list
        if mixed
        else [
            {"c_type": p.c_type, "suffix": s, "expr": select[s]}
            for p, s in zip(frag.params, suffixes, strict=True)
        ],
        multi=len(segments) > 1 and not f.paired,
        mixed=mixed,
        b_parts=b_parts,
        b_args=b_args,
        paired=f.paired,
        epilogue=f.epilogue,
        pair_value=pair_value(GATE_ACTS[f.gate_act]),
        cap=c_cap(f.cap),
        target=f.target.arch if f.target else "",
        fp4_cvt=bool(f.target and f.target.fp4_cvt and any(p.e2m1 for p in f.fragments)),
        bias_decl=bias_decl,
        g_value=g_value,
        u_value=u_value,
    )
    if grouped is not None:
        context.update(grouped.context)
    context["b_loader"] = _b_loader(context)
    source = render(template, **context)
    return Kernel(
        name,
        source,
        tuple(params),
        (tile.threads, 1, 1),
        (common_header(), mma_header(), gemm_header()),
    )


def pair_value(gate_fn: str, swiglu: tuple[str, str] | None = None) -> str:
    """A gate/up pair's result from its sums v (gate) and uv (up), before the store rounds it:
    act(g) * u, or gpt-oss's clamped SwiGLU with (limit, alpha); each factor rounded as the
    separate ops store it."""
    if swiglu is None:
        return f"qir_round<act_t>({gate_fn}(qir_round<act_t>(v))) * qir_round<act_t>(uv)"
    limit, alpha = swiglu
    return (
        f"qir_round<act_t>(qir_swiglu_gate(qir_round<act_t>(v), {limit}, {alpha})) * "
        f"qir_round<act_t>(qir_swiglu_up(qir_round<act_t>(uv), {limit}))"
    )


def _params(spec: GemmSpec, frag: Fragment) -> list[KernelParam]:
    """The GEMV's parameter list (lowering binds both families' launches alike)."""
    f = spec
    act_in = f"const {f.act.c_type}* __restrict__"
    inputs: tuple[KernelParam, ...]
    if f.prologue:
        inputs = (KernelParam("g", act_in, "buffer"), KernelParam("u", act_in, "buffer"))
    elif f.norm:
        inputs = norm_params(act_in, f.norm, f.res_norm)
    elif f.a4 and not f.native:
        inputs = (KernelParam("xq", "const uint8_t* __restrict__", "buffer"),)
    else:
        inputs = (KernelParam("x", act_in, "buffer"),)
    scale = f.a4 and (f.prologue or f.native) and f.a4_mode != "dynamic"
    return [
        *inputs,
        *weight_params(f.weights),
        *(
            KernelParam(f"y{j}", f"{f.act.c_type}* __restrict__", "buffer")
            for j in range(1 if f.paired else len(f.weights))
        ),
        *h_param(f.act, f.res_norm),
        *((KernelParam("r", act_in, "buffer"),) if f.epilogue == "residual" else ()),
        *((KernelParam("act_scale", "const float* __restrict__", "buffer"),) if scale else ()),
        KernelParam("M", "int", "int"),
    ]


def _formats(weights: tuple[QWeight, ...]) -> str:
    """The weights' formats as a comment spells them: one, or each in turn."""
    return " and ".join(dict.fromkeys(w.format.spell() for w in weights))


def _doc(spec: GemmSpec) -> list[str]:
    """The comment lines at the top of the kernel: what it computes and how it is tiled."""
    f, t = spec, spec.tile
    w0 = f.weights[0]
    x = f"{f.gate_act}(g) * u" if f.prologue else "x"
    if f.norm:
        x = norm_doc(f.norm, f.res_norm)
    if f.a4:
        x = f"nvfp4({x})"
    lines = []
    b = [f" + b{j}" if w.bias else "" for j, w in enumerate(f.weights)]
    if f.paired:
        lines.append(
            f"y0 = {f.gate_act}({x} W0^T{b[0]}) * ({x} W1^T{b[1]}); W0, W1 are "
            f"[{w0.out_features}, {w0.in_features}] in {_formats(f.weights)}"
        )
    elif f.cap is not None:
        lines.append(
            f"y0 = tanh({x} W0^T{b[0]} / {f.cap:g}) * {f.cap:g}; W0 is "
            f"[{w0.out_features}, {w0.in_features}] in {w0.format.spell()}"
        )
    else:
        res = "r + " if f.epilogue == "residual" else ""
        for j, w in enumerate(f.weights):
            lines.append(
                f"y{j} = {res}{x} W{j}^T{b[j]}; W{j} is [{w.out_features}, {w.in_features}] in "
                f"{w.format.spell()}"
            )
    lines.append(
        f"Tensor-core GEMM: {t.bm} x {t.bn} tiles (of {t.warps_m} x {t.warps_n} warps, each "
        f"{t.mt} x {t.nt} MMAs), K in steps of {t.bk} through {t.stages} stages; fp32 accumulation."
    )
    if f.native:
        lines += [
            "Blackwell block-scaled FP4 MMA (m16n8k64, UE4M3 scales per 16; sm_120a/sm_121a,",
            "compile-checked only: no machine here runs it; the host backend emulates it). The",
            "activation tile is quantized to NVFP4 in the kernel, as quantize_act would.",
        ]
    elif f.a4:
        lines.append(
            "E2M1 codes decoded exactly into MMA operands; each k16 block's sum scaled by the "
            "two block factors."
        )
    else:
        lines.append(
            "The weight tile is decoded into shared memory by "
            + ("each weight's format's fragment" if f.fused.mixed else "the format's fragment")
            + ("." if f.prologue or f.norm else "; the activation tile arrives by cp.async.")
        )
    return lines
