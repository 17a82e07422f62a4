"""The quantized GEMV kernel family: small M, one warp per output row."""

from __future__ import annotations

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


def gemv_name(w: QWeight, act: DType, m_tile: int) -> str:
    return f"qgemv_{w.format.tag()}_{act.name}_n{w.out_features}_k{w.in_features}_m{m_tile}"


def gemv_kernel(w: QWeight, act: DType, m_tile: int) -> Kernel:
    frag = fragment_for(w.format, w.out_features, w.in_features)
    name = gemv_name(w, act, m_tile)
    act_t = act.c_type
    source = render(
        "qgemv.cu.j2",
        name=name,
        format_spelling=w.format.spell(),
        fragment_template=frag.template,
        weight_params=frag.params,
        act_t=act_t,
        N=w.out_features,
        K=w.in_features,
        m_tile=m_tile,
        m_unroll=min(m_tile, M_UNROLL),
        min_blocks=MIN_BLOCKS_PER_SM,
        rows_per_block=WARPS_PER_BLOCK,
        threads=32 * WARPS_PER_BLOCK,
        chunks_per_row=frag.chunks_per_row(w.in_features),
        **frag.context,
    )
    params = (
        KernelParam("x", f"const {act_t}* __restrict__", "buffer"),
        *frag.params,
        KernelParam("y", f"{act_t}* __restrict__", "buffer"),
        KernelParam("M", "int", "int"),
    )
    return Kernel(name, source, params, (32 * WARPS_PER_BLOCK, 1, 1), (common_header(),))


def gemv_grid_x(w: QWeight) -> int:
    return -(-w.out_features // WARPS_PER_BLOCK)
