"""Fragment constants for MXFP4 (templates/formats/mxfp4.cuh.j2) and MXFP8
(templates/formats/e4m3.cuh.j2 with E8M0 block scales).

A chunk is exactly one MX block of 32 weights, so each lane reads one scale byte per chunk:
16 bytes of FP4 codes (one 128-bit load) or 32 bytes of FP8 codes (two). Rows start 16-byte
aligned because in_features is a multiple of 32."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, register_fragment
from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat
from qir.formats.mx import GROUP_SIZE, Mxfp4, Mxfp8

_BYTES = "const uint8_t* __restrict__"


@register_fragment("mxfp4")
def _mxfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp4)
    return Fragment(
        template="formats/mxfp4.cuh.j2",
        params=(
            KernelParam("w_weight", _BYTES, "buffer"),
            KernelParam("w_scales", _BYTES, "buffer"),
        ),
        buffers=("weight", "scales"),
        chunk_elems=GROUP_SIZE,
        context={
            "chunk_elems": GROUP_SIZE,
            "chunk_bytes": GROUP_SIZE // 2,
            "chunk_words": GROUP_SIZE // 8,
            "bytes_per_row": in_features // 2,
            "blocks_per_row": in_features // GROUP_SIZE,
        },
    )


@register_fragment("mxfp8")
def _mxfp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp8)
    return Fragment(
        template="formats/e4m3.cuh.j2",
        params=(
            KernelParam("w_weight", _BYTES, "buffer"),
            KernelParam("w_scales", _BYTES, "buffer"),
        ),
        buffers=("weight", "scales"),
        chunk_elems=GROUP_SIZE,
        context={
            "title": "MXFP8",
            "scale_doc": f"each block of {GROUP_SIZE} has an E8M0 scale e: w = e4m3 * 2^(e-127)",
            "scale_t": "uint8_t",
            "scale_buffer": "scales",
            "e8m0_scale": True,
            "chunk_elems": GROUP_SIZE,
            "chunk_bytes": GROUP_SIZE,
            "chunk_words": GROUP_SIZE // 4,
            "vec_words": 4,
            "bytes_per_row": in_features,
            "blocks_per_row": in_features // GROUP_SIZE,
        },
    )
