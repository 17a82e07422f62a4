"""Fragment constants for NVFP4 (templates/formats/nvfp4.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, byte_codes, register_fragment
from qir.formats.base import WeightFormat
from qir.formats.nvfp4 import GROUP_SIZE, Nvfp4

# 32 codes = one 128-bit load per lane, the widest; 16 codes (64 bits) when a row's bytes are
# only 8-byte aligned (in_features an odd multiple of 16).
_CHUNKS = (32, 16)


@register_fragment("nvfp4")
def _nvfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Nvfp4)
    chunk_elems = next(c for c in _CHUNKS if in_features % c == 0)
    return byte_codes(
        "formats/nvfp4.cuh.j2",
        4,
        in_features,
        chunk_elems,
        {"block_scale": "uint8_t", "global_scale": "float"},
        blocks_per_row=in_features // GROUP_SIZE,
        blocks_per_chunk=chunk_elems // GROUP_SIZE,
        scale_op="*" if fmt.scale_mode == "mul" else "/",
    )
