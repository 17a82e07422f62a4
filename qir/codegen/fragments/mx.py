"""Fragment constants for MXFP4 (templates/formats/mxfp4.cuh.j2) and MXFP8
(templates/formats/e4m3.cuh.j2 with E8M0 block scales).

A chunk is exactly one MX block of 32 weights, so each lane reads one scale byte per chunk:
16 bytes of FP4 codes (one 128-bit load) or 32 bytes of FP8 codes (two). Rows start 16-byte
aligned because in_features is a multiple of 32."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, byte_codes, register_fragment
from qir.codegen.fragments.fp8 import e4m3_fragment
from qir.formats.base import WeightFormat
from qir.formats.mx import GROUP_SIZE, Mxfp4, Mxfp8


@register_fragment("mxfp4")
def _mxfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp4)
    return byte_codes(
        "formats/mxfp4.cuh.j2",
        4,
        in_features,
        GROUP_SIZE,
        {"scales": "uint8_t"},
        blocks_per_row=in_features // GROUP_SIZE,
    )


@register_fragment("mxfp8")
def _mxfp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp8)
    return e4m3_fragment(
        in_features,
        GROUP_SIZE,
        "scales",
        "uint8_t",
        title="MXFP8",
        scale_doc=f"each block of {GROUP_SIZE} has an E8M0 scale e: w = e4m3 * 2^(e-127)",
        e8m0_scale=True,
        blocks_per_row=in_features // GROUP_SIZE,
    )
