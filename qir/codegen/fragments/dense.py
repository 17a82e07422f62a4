"""Fragment constants for unquantized weights (templates/formats/dense.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, make_fragment, register_fragment
from qir.formats.base import WeightFormat
from qir.formats.dense import Dense

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
        {"weight": elem_t},
        chunk_elems,
        {
            "dtype": fmt.dtype.name,
            "elem_t": elem_t,
            "chunk_elems": chunk_elems,
            "chunk_words": chunk_elems * size // 4,
            "in_features": in_features,
        },
    )
