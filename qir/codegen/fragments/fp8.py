"""Fragment constants for FP8 E4M3 with a float32 scale per row or tensor
(templates/formats/e4m3.cuh.j2, which MXFP8 shares through `e4m3_fragment`)."""

from __future__ import annotations

from typing import Any

from qir.codegen.fragments import Fragment, byte_codes, register_fragment
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8

# Widest chunk first: 32 codes are two 128-bit loads per lane; rows whose length is only a
# multiple of 16 or 8 bytes keep each load aligned with one 128-bit or one 64-bit load.
_CHUNKS = (32, 16, 8)


def e4m3_fragment(
    in_features: int, chunk_elems: int, scale_buffer: str, scale_t: str, **context: Any
) -> Fragment:
    """The e4m3.cuh.j2 fragment: E4M3 bytes, then one scale buffer `scale_buffer` of C type
    `scale_t`; `context` says how the template picks a chunk's scale (title, scale_doc,
    e8m0_scale and scale_index or blocks_per_row)."""
    return byte_codes(
        "formats/e4m3.cuh.j2",
        8,
        in_features,
        chunk_elems,
        {scale_buffer: scale_t},
        scale_t=scale_t,
        scale_buffer=scale_buffer,
        vec_words=4 if chunk_elems >= 16 else 2,
        **context,
    )


@register_fragment("fp8")
def _fp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Fp8)
    chunk_elems = next(c for c in _CHUNKS if in_features % c == 0)
    per_row = fmt.granularity == "channel"
    return e4m3_fragment(
        in_features,
        chunk_elems,
        "scale",
        "float",
        title="FP8",
        scale_doc=f"w = e4m3 * scale, one float32 scale per {'row' if per_row else 'tensor'}",
        e8m0_scale=False,
        scale_index="row" if per_row else "0",
    )
