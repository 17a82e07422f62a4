"""Fragment constants for the small-float weight formats (templates/formats/float_codes.cuh.j2):
FP8 E4M3 with a float32 scale per row or tensor or per 128 x 128 block, MXFP8 and MXFP4 (E4M3 / E2M1 with an E8M0
scale per block of 32) and NVFP4 (E2M1 with an E4M3 scale per block of 16 and a float32 one per
tensor).

Codes are stored one per byte (E4M3) or two per byte (E2M1, element 2k in the low nibble of
byte k); a chunk is 32 codes where the row allows (one or two 128-bit loads), else 16 or 8.

Packed decode: E4M3 goes through the hardware conversion to an f16 pair on sm_89 and later (a
bit move elsewhere), then is scaled by 2^-shift; E2M1 reaches an f16 pair as value * 2^-6 (see
qir_e2m1x8_to_f16x2). The overflow bound of int_codes.py applies with code_max = 448 (E4M3) or 6
(E2M1); E2M1's fixed 2^-6 is not enough for runs of 16 pairs, so the GEMV also scales the
activations by 2^-act_shift (exact above 2^-(14 - act_shift), a few ulps of 2^-24 below)."""

from __future__ import annotations

from qir.codegen.fragments.base import (
    MAX_RUN_PAIRS,
    Fragment,
    FragmentBuffer,
    byte_codes,
    overflow_shift,
    register_fragment,
)
from qir.formats.fp8 import Fp8
from qir.formats.fp8_block import Fp8Block, blocks
from qir.formats.mx import GROUP_SIZE as MX_BLOCK
from qir.formats.mx import Mxfp4, Mxfp8
from qir.formats.nvfp4 import GROUP_SIZE as NVFP4_BLOCK
from qir.formats.nvfp4 import Nvfp4
from qir.types import WeightFormat

E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1_SHIFT = 6  # qir_e2m1x8_to_f16x2 yields value * 2^-6
# Products per run half for E4M3: 8 pairs (a 16-byte load) keep the shift at 14, so that
# products under 2^-14 in f16 are those below 1 in units of e4m3 * x.
_E4M3_RUN_PAIRS = 8


def _fragment(
    bits: int,
    in_features: int,
    chunk_elems: int,
    run_elems: int,
    scales: dict[str, FragmentBuffer],
    **context: object,
) -> Fragment:
    run_pairs = run_elems // 2
    if bits == 8:
        shift, act_shift = overflow_shift(run_pairs, E4M3_MAX), 0
    else:
        shift = E2M1_SHIFT
        act_shift = max(0, overflow_shift(run_pairs, E2M1_MAX) - E2M1_SHIFT)
    return byte_codes(
        "formats/float_codes.cuh.j2",
        bits,
        in_features,
        chunk_elems,
        scales,
        packed=True,
        runs=chunk_elems // run_elems,
        run_steps=run_elems // 8,
        code_shift=shift,
        act_shift=act_shift,
        **context,
    )


# Widest chunk first: 32 codes are two 128-bit loads per lane; rows whose length is only a
# multiple of 16 or 8 bytes keep each load aligned with one 128-bit or one 64-bit load.
_FP8_CHUNKS = (32, 16, 8)


@register_fragment("fp8")
def _fp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Fp8)
    chunk = next(c for c in _FP8_CHUNKS if in_features % c == 0)
    per_row = fmt.granularity == "channel"
    return _fragment(
        8,
        in_features,
        chunk,
        min(chunk, 2 * _E4M3_RUN_PAIRS),
        {"scale": ("float", 1 if per_row else 0)},
        title="FP8",
        scale="row" if per_row else "tensor",
        split_scale=True,
        scale_doc=f"w = e4m3 * scale, one float32 scale per {'row' if per_row else 'tensor'}",
    )


@register_fragment("fp8_block")
def _fp8_block(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    """A chunk (32, 16 or 8 codes) never straddles a 128-wide scale block: the block's scale is
    loaded with the chunk's codes and applied to each run's sum, like MXFP8's."""
    assert isinstance(fmt, Fp8Block)
    chunk = next(c for c in _FP8_CHUNKS if in_features % c == 0)
    assert fmt.block_in % chunk == 0
    return _fragment(
        8,
        in_features,
        chunk,
        min(chunk, 2 * _E4M3_RUN_PAIRS),
        {"scale": ("float", blocks(in_features, fmt.block_in), fmt.block_out)},
        title="block FP8",
        scale="block",
        chunks_per_block=fmt.block_in // chunk,
        scale_doc=(
            f"rows of {fmt.block_out} share a row of float32 scales, one per {fmt.block_in} "
            f"inputs: w = e4m3 * scale[row / {fmt.block_out}][k / {fmt.block_in}]"
        ),
    )


@register_fragment("mxfp8")
def _mxfp8(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp8)
    return _fragment(
        8,
        in_features,
        MX_BLOCK,
        2 * _E4M3_RUN_PAIRS,
        {"scales": ("uint8_t", in_features // MX_BLOCK)},
        title="MXFP8",
        scale="e8m0",
        blocks_per_row=in_features // MX_BLOCK,
        scale_doc=f"each block of {MX_BLOCK} has an E8M0 scale e: w = e4m3 * 2^(e-127)",
    )


@register_fragment("mxfp4")
def _mxfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Mxfp4)
    return _fragment(
        4,
        in_features,
        MX_BLOCK,
        min(MX_BLOCK, 2 * MAX_RUN_PAIRS),
        {"scales": ("uint8_t", in_features // MX_BLOCK)},
        title="MXFP4",
        scale="e8m0",
        blocks_per_row=in_features // MX_BLOCK,
        scale_doc=f"each block of {MX_BLOCK} has an E8M0 scale e: w = e2m1 * 2^(e-127)",
    )


# 32 codes = one 128-bit load per lane, the widest; 16 codes (64 bits) when a row's bytes are
# only 8-byte aligned (in_features an odd multiple of 16).
_NVFP4_CHUNKS = (32, 16)


@register_fragment("nvfp4")
def _nvfp4(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Nvfp4)
    chunk = next(c for c in _NVFP4_CHUNKS if in_features % c == 0)
    op = "*" if fmt.scale_mode == "mul" else "/"
    return _fragment(
        4,
        in_features,
        chunk,
        NVFP4_BLOCK,
        {
            "block_scale": ("uint8_t", in_features // NVFP4_BLOCK),
            "global_scale": ("float", 0),
        },
        title="NVFP4",
        scale="nvfp4",
        split_scale=True,
        scale_op=op,
        blocks_per_row=in_features // NVFP4_BLOCK,
        blocks_per_chunk=chunk // NVFP4_BLOCK,
        scale_doc=(
            f"each block of {NVFP4_BLOCK} has an E4M3 scale s and the tensor one float32 g: "
            f"w = e2m1 * (s {op} g), the block factor formed first as the producer's decoder does"
        ),
    )
