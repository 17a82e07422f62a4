"""The quantized GEMV kernel family: small M, one warp per output row.

One template covers every fusion: several weights sharing one input (one output each), the
SiLU-gate prologue, the residual epilogue; the weight format enters only as its fragment.
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


@dataclass(frozen=True)
class GemvSpec:
    weights: tuple[QWeight, ...]  # one format and one in_features
    act: DType
    m_tile: int
    prologue: bool = False  # input = silu(g) * u
    epilogue: bool = False  # y = r + x W^T

    def __post_init__(self) -> None:
        formats = {(w.format, w.in_features) for w in self.weights}
        if len(formats) != 1:
            raise ValueError(f"one GEMV launch needs one format and in_features, got {formats}")
        if self.epilogue and len(self.weights) != 1:
            raise ValueError("the residual epilogue takes exactly one weight")

    @property
    def name(self) -> str:
        w0 = self.weights[0]
        outs = "_".join(str(w.out_features) for w in self.weights)
        fused = ("_silu" if self.prologue else "") + ("_res" if self.epilogue else "")
        return f"qgemv_{w0.format.tag()}_{self.act.name}_n{outs}_k{w0.in_features}_m{self.m_tile}{fused}"

    def blocks(self, w: QWeight) -> int:
        return -(-w.out_features // WARPS_PER_BLOCK)

    @property
    def grid_x(self) -> int:
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
        act_t=act_t,
        K=w0.in_features,
        m_tile=spec.m_tile,
        m_unroll=min(spec.m_tile, M_UNROLL),
        min_blocks=MIN_BLOCKS_PER_SM,
        rows_per_block=WARPS_PER_BLOCK,
        threads=32 * WARPS_PER_BLOCK,
        chunks_per_row=frag.chunks_per_row(w0.in_features),
        **frag.context,
    )
    act_in = f"const {act_t}* __restrict__"
    params = [
        *(
            (KernelParam("g", act_in, "buffer"), KernelParam("u", act_in, "buffer"))
            if spec.prologue
            else (KernelParam("x", act_in, "buffer"),)
        ),
        *(
            KernelParam(f"w{j}_{p['suffix']}", p["c_type"], "buffer")
            for j in range(len(spec.weights))
            for p in frag_params
        ),
        *(
            KernelParam(f"y{j}", f"{act_t}* __restrict__", "buffer")
            for j in range(len(spec.weights))
        ),
        *((KernelParam("r", act_in, "buffer"),) if spec.epilogue else ()),
        KernelParam("M", "int", "int"),
    ]
    return Kernel(
        spec.name, source, tuple(params), (32 * WARPS_PER_BLOCK, 1, 1), (common_header(),)
    )
