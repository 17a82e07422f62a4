"""The quantized GEMV kernel family: small M, one warp per output row.

One template covers every fusion: several weights sharing one input (one output each), the
SiLU-gate prologue, the residual epilogue, and gate/up paired in one warp with silu(g) * u as
the epilogue; the weight format enters only as its fragment.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.codegen.fragments import fragment_for
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import common_header, render
from qir.dtypes import DType
from qir.types import QWeight

WARPS_PER_BLOCK = 4
# Unrolling all x rows lets the compiler hoist every row's loads at once and spill (seen with
# f32 activations and m_tile 8 on sm_90); 4 rows at a time keeps the loads in registers.
M_UNROLL = 4
# Resident blocks per SM the register allocation must allow. Without a minimum ptxas picked
# 40 registers and spilled for 8-bit K=256 kernels; 4 blocks of 128 threads still leaves each
# thread up to 128 registers, which no fragment needs.
MIN_BLOCKS_PER_SM = 4
# Epilogue -> its kernel-name suffix.
EPILOGUES = {"": "", "residual": "_res", "silu_mul": "_silumul"}


@dataclass(frozen=True)
class GemvSpec:
    weights: tuple[QWeight, ...]  # one format and one in_features
    act: DType
    m_tile: int
    prologue: bool = False  # input = silu(g) * u
    # "residual": y = r + x W^T; "silu_mul": two weights (gate, up), each warp computes row n of
    # both and stores one result silu(x Wg^T) * (x Wu^T).
    epilogue: str = ""
    # W4A4: the input is NVFP4 codes + factors from quantize_act, or (with the prologue)
    # silu(g) * u quantized in registers with a per-row ("dynamic") or calibrated scale.
    a4: bool = False
    a4_mode: str = "dynamic"  # dynamic | mul | div (prologue only)

    def __post_init__(self) -> None:
        formats = {(w.format, w.in_features) for w in self.weights}
        if len(formats) != 1:
            raise ValueError(f"one GEMV launch needs one format and in_features, got {formats}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {self.epilogue!r}; known: {EPILOGUES}")
        if self.epilogue == "residual" and len(self.weights) != 1:
            raise ValueError("the residual epilogue takes exactly one weight")
        if self.epilogue == "silu_mul" and (
            len(self.weights) != 2 or self.weights[0] != self.weights[1] or self.prologue
        ):
            raise ValueError("the silu_mul epilogue takes two weights of one shape, no prologue")
        if self.a4 and self.weights[0].format.act_quant_scheme() != "nvfp4":
            raise ValueError(f"W4A4 needs NVFP4 weights, got {self.weights[0].format.spell()}")

    @property
    def name(self) -> str:
        w0 = self.weights[0]
        outs = "_".join(str(w.out_features) for w in self.weights)
        fused = ("_silu" if self.prologue else "") + EPILOGUES[self.epilogue]
        if self.a4:
            fused += "_a4" + (self.a4_mode if self.prologue else "")
        return f"qgemv_{w0.format.tag()}_{self.act.name}_n{outs}_k{w0.in_features}_m{self.m_tile}{fused}"

    def blocks(self, w: QWeight) -> int:
        return -(-w.out_features // WARPS_PER_BLOCK)

    @property
    def paired(self) -> bool:
        """Each warp computes one row of every weight (one launch's blocks serve them all)."""
        return self.epilogue == "silu_mul"

    @property
    def grid_x(self) -> int:
        if self.paired:
            return self.blocks(self.weights[0])
        return sum(self.blocks(w) for w in self.weights)


def gemv_kernel(spec: GemvSpec) -> Kernel:
    w0 = spec.weights[0]
    frag = fragment_for(w0.format, w0.out_features, w0.in_features)
    act_t = spec.act.c_type
    frag_params = [{"c_type": p.c_type, "suffix": p.name.removeprefix("w_")} for p in frag.params]
    weights, start = [], 0
    for j, w in enumerate(spec.weights):
        end = start + spec.blocks(w)
        weights.append({"j": j, "N": w.out_features, "block_start": start, "block_end": end})
        start = end
    source = render(
        "qgemv.cu.j2",
        name=spec.name,
        format_spelling=w0.format.spell(),
        fragment_template=frag.template,
        frag_params=frag_params,
        weights=weights,
        prologue=spec.prologue,
        epilogue=spec.epilogue,
        paired=spec.paired,
        a4=spec.a4,
        a4_mode=spec.a4_mode,
        row_bytes=w0.in_features // 2 + 4 * (w0.in_features // 16),
        act_t=act_t,
        K=w0.in_features,
        m_tile=spec.m_tile,
        # Quantizing the prologue's blocks in registers spills when rows or blocks are unrolled
        # (216 bytes on sm_80/sm_90 with 2 blocks); one block of one row at a time does not.
        # A W4A4 pair (two weights' codes per chunk) spills with 2 blocks unrolled (1068 bytes
        # on sm_80); one block at a time does not.
        m_unroll=1 if spec.a4 and spec.prologue else min(spec.m_tile, M_UNROLL),
        block_unroll=1 if spec.prologue or (spec.a4 and spec.paired) else 2,
        min_blocks=MIN_BLOCKS_PER_SM,
        rows_per_block=WARPS_PER_BLOCK,
        threads=32 * WARPS_PER_BLOCK,
        chunks_per_row=frag.chunks_per_row(w0.in_features),
        **frag.context,
    )
    act_in = f"const {act_t}* __restrict__"
    inputs: tuple[KernelParam, ...]
    if spec.prologue:
        inputs = (KernelParam("g", act_in, "buffer"), KernelParam("u", act_in, "buffer"))
    elif spec.a4:
        inputs = (KernelParam("xq", "const uint8_t* __restrict__", "buffer"),)
    else:
        inputs = (KernelParam("x", act_in, "buffer"),)
    scale = spec.a4 and spec.prologue and spec.a4_mode != "dynamic"
    params = [
        *inputs,
        *(
            KernelParam(f"w{j}_{p['suffix']}", p["c_type"], "buffer")
            for j in range(len(spec.weights))
            for p in frag_params
        ),
        *(
            KernelParam(f"y{j}", f"{act_t}* __restrict__", "buffer")
            for j in range(1 if spec.paired else len(spec.weights))
        ),
        *((KernelParam("r", act_in, "buffer"),) if spec.epilogue == "residual" else ()),
        *((KernelParam("act_scale", "const float* __restrict__", "buffer"),) if scale else ()),
        KernelParam("M", "int", "int"),
    ]
    return Kernel(
        spec.name, source, tuple(params), (32 * WARPS_PER_BLOCK, 1, 1), (common_header(),)
    )
