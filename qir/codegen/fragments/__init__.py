"""Per-format device dequant fragments: Python computes each fragment's constants and kernel
parameters from the format; the fragment template only substitutes them.

A fragment defines `qir_dequant_chunk(<weight params>, row, chunk, float (&wv)[chunk_elems])`,
which dequantizes weights [chunk*chunk_elems, (chunk+1)*chunk_elems) of one output row.

What several fragments share lives here: `make_fragment` (one `const T*` kernel parameter per
buffer), `byte_codes` (FP4/FP8 codes packed into bytes along the row) and `bitstream_chunking`
(integer codes in little-endian uint32 bitstreams)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat


@dataclass(frozen=True)
class Fragment:
    template: str
    params: tuple[KernelParam, ...]  # in the order of the format's buffers()
    buffers: tuple[str, ...]
    chunk_elems: int
    context: dict[str, Any]

    def chunks_per_row(self, in_features: int) -> int:
        return in_features // self.chunk_elems


# Per-lane register budget: a chunk is dequantized into this many floats at most.
MAX_CHUNK_ELEMS = 64

MakeFragment = Callable[[WeightFormat, int, int], Fragment]
FRAGMENTS: dict[str, MakeFragment] = {}


def register_fragment(name: str) -> Callable[[MakeFragment], MakeFragment]:
    """Registers the function that builds a format's fragment; one module per fragment."""

    def deco(fn: MakeFragment) -> MakeFragment:
        FRAGMENTS[name] = fn
        return fn

    return deco


def make_fragment(
    template: str, buffers: Mapping[str, str], chunk_elems: int, context: dict[str, Any]
) -> Fragment:
    """A fragment whose kernel parameters are `const T* __restrict__ w_<buffer>`, one per entry
    of `buffers` (buffer name -> C element type T), in the order of the format's buffers()."""
    params = tuple(
        KernelParam(f"w_{name}", f"const {c_type}* __restrict__", "buffer")
        for name, c_type in buffers.items()
    )
    return Fragment(template, params, tuple(buffers), chunk_elems, context)


def byte_codes(
    template: str,
    elem_bits: int,
    in_features: int,
    chunk_elems: int,
    scales: Mapping[str, str],
    **context: Any,
) -> Fragment:
    """A fragment of `elem_bits`-wide float codes (4 or 8) packed into the bytes of each row,
    buffer `weight`, then the scale buffers `scales` (name -> C element type); the context
    gets the chunk's and the row's sizes on top of `context`."""
    chunk_bytes = chunk_elems * elem_bits // 8
    sizes = {
        "chunk_elems": chunk_elems,
        "chunk_bytes": chunk_bytes,
        "chunk_words": chunk_bytes // 4,
        "bytes_per_row": in_features * elem_bits // 8,
    }
    buffers = {"weight": "uint8_t", **scales}
    return make_fragment(template, buffers, chunk_elems, {**sizes, **context})


def bitstream_chunking(
    bits: int, in_features: int, max_elems: int = MAX_CHUNK_ELEMS
) -> dict[str, int]:
    """Chunk constants of a row of `bits`-wide integer codes in a little-endian uint32 bitstream
    (qir.formats.bitstream)."""
    words_per_row = in_features * bits // 32
    if 32 % bits == 0:
        # Codes never straddle words: the widest load (up to 128 bits) dividing the row whose
        # chunk is a whole number of 8-weight activation loads.
        chunk_words = next(
            c
            for c in (4, 2, 1)
            if words_per_row % c == 0 and c * 32 // bits <= max_elems and c * 32 // bits % 8 == 0
        )
        vec_words = chunk_words
    else:
        # 3/5/6-bit: 32 codes fill exactly `bits` words; rows are only 4-byte aligned.
        chunk_words, vec_words = bits, 1
    return {
        "bits": bits,
        "mask": (1 << bits) - 1,
        "words_per_row": words_per_row,
        "chunk_words": chunk_words,
        "vec_words": vec_words,
        "chunk_elems": chunk_words * 32 // bits,
    }


def fragment_for(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    try:
        make = FRAGMENTS[fmt.fragment]
    except KeyError:
        raise NotImplementedError(f"no device dequant fragment for {fmt.spell()} yet") from None
    return make(fmt, out_features, in_features)


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_load_all()
