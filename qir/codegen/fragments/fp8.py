"""Fragment constants for FP8 E4M3 with a float32 scale per row or tensor
(templates/formats/e4m3.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, register_fragment
from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8

# Widest chunk first: 32 codes are two 128-bit loads per lane; rows whose length is only a
# multiple of 16 or 8 bytes keep each load aligned with one 128-bit or one 64-bit load.
_CHUNKS = (32, 16, 8)


@register_fragment("fp8")
def _fp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Fp8)
    chunk_elems = next(c for c in _CHUNKS if in_features % c == 0)
    per_row = fmt.granularity == "channel"
    return Fragment(
        template="formats/e4m3.cuh.j2",
        params=(
            KernelParam("w_weight", "const uint8_t* __restrict__", "buffer"),
            KernelParam("w_scale", "const float* __restrict__", "buffer"),
        ),
        buffers=("weight", "scale"),
        chunk_elems=chunk_elems,
        context={
            "title": "FP8",
            "scale_doc": f"w = e4m3 * scale, one float32 scale per {'row' if per_row else 'tensor'}",
            "scale_t": "float",
            "scale_buffer": "scale",
            "e8m0_scale": False,
            "scale_index": "row" if per_row else "0",
            "chunk_elems": chunk_elems,
            "chunk_bytes": chunk_elems,
            "chunk_words": chunk_elems // 4,
            "vec_words": 4 if chunk_elems >= 16 else 2,
            "bytes_per_row": in_features,
        },
    )
