"""Fragment constants for the integer-code formats: AWQ, GPTQ and compressed-tensors int decode
`(q - zero) * scale`, MLX affine `q * scale + bias` (templates/formats/int_codes.cuh.j2).

All of them store each row's codes as a little-endian bitstream along the input dim; they differ
in where a group's zero comes from (packed nibbles, a byte plus an offset, a constant), whether
a bias follows the scale, and whether a group is `i // group_size` or a per-channel `g_idx`
lookup (act-order, which has no packed decode: every weight has its own scale).

Packed decode (see fragments/__init__.py): a code becomes half of a T pair by the magic-number
trick. Placed in the mantissa of 2^W (W = 10 for f16, 7 for bf16: the bits below the exponent
whose unit is 1), at bit `pos`, the pair reads 2^W + q * 2^pos; one fma2 with constants then
gives (q - zero) * 2^-shift exactly. Codes whose fields fit the window are read without a shift
(4-bit f16: two of the four pairs of a word), the others after one.

Overflow bound: the GEMV sums a run's products in T pairs and then adds the pair's halves in T,
2 * run_pairs products in all. With |q - zero| <= code_max and every activation |x| <= 65504,
2^shift >= 4 * run_pairs * code_max keeps every such sum (and the rounding on the way) below
half of 65504 for any finite f16 input. The price: products under 2^-14 are f16 subnormals,
an absolute error of at most 2^(shift-25) per product in units of (q - zero) * x, below the
rounding error of any product above 2^(shift-14) (shift = 10 for 4-bit groups of 32 or more).
MLX codes are centered (q - 2^(bits-1), the bias moved by 2^(bits-1) * scale) to halve
code_max and to keep the bias term, which the GEMV adds once per run as bias * sum(x), from
cancelling most of the codes' sum.
"""

from __future__ import annotations

from math import gcd
from typing import Any

from qir.codegen.fragments.base import (
    MAX_CHUNK_ELEMS,
    MAX_RUN_PAIRS,
    Fragment,
    bitstream_chunking,
    make_fragment,
    overflow_shift,
    register_fragment,
)
from qir.formats.awq import Awq, zeros_width
from qir.formats.ct_int import CtInt
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.types import WeightFormat

# An act-order chunk keeps each weight's group index and scale live; at 64 weights (2-bit) that
# spilled 16 bytes on sm_80, so those chunks stop at 32 weights.
_MAX_GIDX_CHUNK_ELEMS = 32
# Mantissa bits below the magic exponent (the unit-1 window) of f16 and bf16.
_WINDOW = {"f16": 10, "bf16": 7}


def _span(bits: int, zero_max: int, window: int) -> int:
    """Bits of a word whose codes are read without a shift: a code field at `pos` must fit the
    window, and so must the zero added at the same scale (zero * 2^pos < 2^(window - ...))."""
    zero_bits = max(zero_max, 1).bit_length()
    top = min(window - bits, window - zero_bits)  # the highest field position allowed
    return bits * (top // bits + 1)


def _fragment(
    fmt_bits: int,
    in_features: int,
    group_size: int,
    buffers: dict[str, tuple[str, int]],
    *,
    what: str,
    zero: str,
    zero_max: int,
    code_max: int,
    scale_t: str,
    bias: bool = False,
    max_elems: int = MAX_CHUNK_ELEMS,
    **context: Any,
) -> Fragment:
    chunking = bitstream_chunking(fmt_bits, in_features, max_elems)
    chunk_elems = chunking["chunk_elems"]
    bits = fmt_bits
    if 32 % bits == 0 and bits < 8:
        stride, step = 16 // bits, 32 // bits  # one word: codes (e, e + 16/bits)
    else:
        stride, step = 1, 8  # 8-bit: byte pairs; 3/5/6-bit: codes read one by one
    group_elems = gcd(chunk_elems, group_size)  # a run never spans two groups
    run_elems = min(group_elems, 2 * MAX_RUN_PAIRS)
    run_elems = max(run_elems, step)
    run_pairs = run_elems // 2
    groups_in_chunk = max(1, chunk_elems // group_size)
    g_idx = bool(context.pop("g_idx", False))
    return make_fragment(
        "formats/int_codes.cuh.j2",
        buffers,
        chunk_elems,
        {
            **chunking,
            **context,
            "what": what,
            "group_size": group_size,
            "zero": zero,
            "scale_t": scale_t,
            "bias": bias,
            "packed": not g_idx,
            "g_idx": g_idx,
            "gathers": g_idx,
            "step": step,
            "stride": stride,
            "run_steps": run_elems // step,
            "runs": chunk_elems // run_elems,
            "code_shift": overflow_shift(run_pairs, code_max),
            "groups_in_chunk": groups_in_chunk,
            "span16": _span(bits, zero_max, _WINDOW["f16"]),
            "span_bf16": _span(bits, zero_max, _WINDOW["bf16"]),
        },
    )


@register_fragment("awq")
def _awq(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Awq)
    zw = zeros_width(in_features, fmt.group_size)
    return _fragment(
        fmt.bits,
        in_features,
        fmt.group_size,
        {
            "weight": ("uint32_t", in_features // 8),
            "zeros": ("uint32_t", zw),
            "scales": ("__half", 8 * zw),
        },
        what=f"AutoAWQ int{fmt.bits}, zeros packed 8 per word",
        zero="packed4",
        zero_max=15,
        code_max=15,
        scale_t="__half",
        zero_offset=0,
    )


@register_fragment("gptq")
def _gptq(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Gptq)
    scale_t = fmt.scale_dtype.c_type
    groups = fmt.group_count(in_features)
    buffers = {
        "weight": ("uint32_t", in_features * fmt.bits // 32),
        "zeros": ("uint8_t", groups),
        "scales": (scale_t, groups),
    }
    if fmt.act_order:
        buffers["g_idx"] = ("int32_t", 0)
    zero_max = (1 << fmt.bits) - 1 + fmt.zero_offset
    return _fragment(
        fmt.bits,
        in_features,
        fmt.group_size,
        buffers,
        what=f"GPTQ int{fmt.bits} ({fmt.checkpoint_format}), one zero byte per group",
        zero="u8",
        zero_max=zero_max,
        code_max=max(zero_max, (1 << fmt.bits) - 1),
        scale_t=scale_t,
        max_elems=_MAX_GIDX_CHUNK_ELEMS if fmt.act_order else MAX_CHUNK_ELEMS,
        zero_offset=fmt.zero_offset,
        g_idx=bool(fmt.act_order),
    )


@register_fragment("ct_int")
def _ct_int(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, CtInt)
    scale_t = fmt.scale_dtype.c_type
    return _fragment(
        fmt.bits,
        in_features,
        fmt.group_size,
        {
            "weight": ("uint32_t", in_features * fmt.bits // 32),
            "scales": (scale_t, in_features // fmt.group_size),
        },
        what=f"compressed-tensors int{fmt.bits}, symmetric, offset-binary codes",
        zero="const",
        zero_max=fmt.offset,
        code_max=fmt.offset,
        scale_t=scale_t,
        zero_offset=fmt.offset,
    )


@register_fragment("mlx_affine")
def _mlx_affine(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, MlxAffine)
    scale_t = fmt.scale_dtype.c_type
    center = 1 << (fmt.bits - 1)
    return _fragment(
        fmt.bits,
        in_features,
        fmt.group_size,
        {
            "weight": ("uint32_t", in_features * fmt.bits // 32),
            "scales": (scale_t, in_features // fmt.group_size),
            "biases": (scale_t, in_features // fmt.group_size),
        },
        what=f"MLX affine {fmt.bits}-bit: w = q * scale + bias per group",
        zero="const",
        zero_max=center,
        code_max=center,
        scale_t=scale_t,
        bias=True,
        zero_offset=center,
    )
