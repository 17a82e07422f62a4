"""Fragment constants for unquantized weights (templates/formats/dense.cuh.j2).

Not packed: a GEMV multiplies dense weights in float. There is no decode to save, the 16-bit
weight itself is already a pair, and a product of two arbitrary f16 values can overflow f16
where the float reference does not."""

from __future__ import annotations

from qir.codegen.fragments.base import Fragment, make_fragment, register_fragment
from qir.formats.dense import Dense
from qir.types import WeightFormat

# Bytes one lane reads per chunk: two 128-bit loads where the row length allows, else one.
_CHUNK_BYTES = (32, 16)


@register_fragment("dense")
def _dense(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Dense)
    size = fmt.dtype.itemsize
    chunk_bytes = next(b for b in _CHUNK_BYTES if in_features * size % b == 0)
    chunk_elems = chunk_bytes // size
    elem_t = fmt.dtype.c_type
    return make_fragment(
        "formats/dense.cuh.j2",
        {"weight": (elem_t, in_features)},
        chunk_elems,
        {
            "packed": False,
            "dtype": fmt.dtype.name,
            "elem_t": elem_t,
            "chunk_words": chunk_bytes // 4,
            "in_features": in_features,
        },
    )
