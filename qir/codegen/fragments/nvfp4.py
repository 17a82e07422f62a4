"""Fragment constants for NVFP4 (templates/formats/nvfp4.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, register_fragment
from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat
from qir.formats.nvfp4 import GROUP_SIZE, Nvfp4

# 32 codes = one 128-bit load per lane, the widest; 16 codes (64 bits) when a row's bytes are
# only 8-byte aligned (in_features an odd multiple of 16).
_CHUNKS = (32, 16)


@register_fragment("nvfp4")
def _nvfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Nvfp4)
    chunk_elems = next(c for c in _CHUNKS if in_features % c == 0)
    params = (
        KernelParam("w_weight", "const uint8_t* __restrict__", "buffer"),
        KernelParam("w_block_scale", "const uint8_t* __restrict__", "buffer"),
        KernelParam("w_global_scale", "const float* __restrict__", "buffer"),
    )
    return Fragment(
        template="formats/nvfp4.cuh.j2",
        params=params,
        buffers=("weight", "block_scale", "global_scale"),
        chunk_elems=chunk_elems,
        context={
            "bytes_per_row": in_features // 2,
            "chunk_bytes": chunk_elems // 2,
            "chunk_words": chunk_elems // 8,
            "chunk_elems": chunk_elems,
            "blocks_per_row": in_features // GROUP_SIZE,
            "blocks_per_chunk": chunk_elems // GROUP_SIZE,
            "scale_op": "*" if fmt.scale_mode == "mul" else "/",
        },
    )
