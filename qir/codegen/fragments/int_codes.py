"""Fragment constants for the integer-code formats with `(q - zero) * scale` decode: AWQ, GPTQ
and compressed-tensors int (templates/formats/int_codes.cuh.j2).

All three store each row's codes as a little-endian bitstream along the input dim; they differ
only in where a group's zero comes from (packed nibbles, a byte plus an offset, a constant) and
whether a group is `i // group_size` or a per-channel `g_idx` lookup.
"""

from __future__ import annotations

from math import gcd
from typing import Any

from qir.codegen.fragments import (
    MAX_CHUNK_ELEMS,
    Fragment,
    bitstream_chunking,
    make_fragment,
    register_fragment,
)
from qir.formats.awq import Awq, zeros_width
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.gptq import Gptq

# An act-order chunk also keeps each weight's group index and scale live; at 64 weights (2-bit)
# that spilled 16 bytes on sm_80, so those chunks stop at 32 weights.
_MAX_GIDX_CHUNK_ELEMS = 32


def _fragment(buffers: dict[str, str], context: dict[str, Any]) -> Fragment:
    chunk_elems = context["chunk_elems"]
    # Sub-chunks of gcd(chunk, group) weights start on multiples of it, so none spans two groups.
    sub_elems = gcd(chunk_elems, context["group_size"])
    context = {**context, "sub_elems": sub_elems, "subgroups": chunk_elems // sub_elems}
    return make_fragment("formats/int_codes.cuh.j2", buffers, chunk_elems, context)


@register_fragment("awq")
def _awq(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Awq)
    zw = zeros_width(in_features, fmt.group_size)
    context = {
        **bitstream_chunking(fmt.bits, in_features),
        "what": f"AutoAWQ int{fmt.bits}, zeros packed 8 per word",
        "group_size": fmt.group_size,
        "zero_mode": "packed4",
        "zero_stride": zw,
        "zero_offset": 0,
        "scale_stride": 8 * zw,
        "scale_t": "__half",
        "g_idx": False,
    }
    return _fragment({"weight": "uint32_t", "zeros": "uint32_t", "scales": "__half"}, context)


@register_fragment("gptq")
def _gptq(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Gptq)
    scale_t = fmt.scale_dtype.c_type
    buffers = {"weight": "uint32_t", "zeros": "uint8_t", "scales": scale_t}
    if fmt.act_order:
        buffers["g_idx"] = "int32_t"
    groups = fmt.groups(in_features)
    max_elems = _MAX_GIDX_CHUNK_ELEMS if fmt.act_order else MAX_CHUNK_ELEMS
    context = {
        **bitstream_chunking(fmt.bits, in_features, max_elems),
        "what": f"GPTQ int{fmt.bits} ({fmt.checkpoint_format}), one zero byte per group",
        "group_size": fmt.group_size,
        "zero_mode": "u8",
        "zero_stride": groups,
        "zero_offset": fmt.zero_offset,
        "scale_stride": groups,
        "scale_t": scale_t,
        "g_idx": bool(fmt.act_order),
    }
    return _fragment(buffers, context)


@register_fragment("ct_int")
def _ct_int(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, CtInt)
    scale_t = fmt.scale_dtype.c_type
    context = {
        **bitstream_chunking(fmt.bits, in_features),
        "what": f"compressed-tensors int{fmt.bits}, symmetric, offset-binary codes",
        "group_size": fmt.group_size,
        "zero_mode": "const",
        "zero_stride": 0,
        "zero_offset": fmt.offset,
        "scale_stride": in_features // fmt.group_size,
        "scale_t": scale_t,
        "g_idx": False,
    }
    return _fragment({"weight": "uint32_t", "scales": scale_t}, context)
