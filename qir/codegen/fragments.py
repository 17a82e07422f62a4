"""Per-format device dequant fragments: Python computes each fragment's constants and kernel
parameters from the format; the fragment template only substitutes them.

A fragment defines `qir_dequant_chunk(<weight params>, row, chunk, float (&wv)[chunk_elems])`,
which dequantizes weights [chunk*chunk_elems, (chunk+1)*chunk_elems) of one output row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat
from qir.formats.mlx import MlxAffine


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


def _mlx_affine(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, MlxAffine)
    words_per_row = in_features * fmt.bits // 32
    if 32 % fmt.bits == 0:
        # Codes never straddle words: take the widest load (up to 128 bits) that divides the row.
        chunk_words = next(
            c for c in (4, 2, 1) if words_per_row % c == 0 and c * 32 // fmt.bits <= MAX_CHUNK_ELEMS
        )
        vec_words = chunk_words
    else:
        # 3/5/6-bit: 32 codes fill exactly `bits` words; rows are only 4-byte aligned.
        chunk_words, vec_words = fmt.bits, 1
    chunk_elems = chunk_words * 32 // fmt.bits
    sub_elems = min(chunk_elems, fmt.group_size)
    scale_t = fmt.scale_dtype.c_type
    params = (
        KernelParam("w_weight", "const uint32_t* __restrict__", "buffer"),
        KernelParam("w_scales", f"const {scale_t}* __restrict__", "buffer"),
        KernelParam("w_biases", f"const {scale_t}* __restrict__", "buffer"),
    )
    return Fragment(
        template="formats/mlx_affine.cuh.j2",
        params=params,
        buffers=("weight", "scales", "biases"),
        chunk_elems=chunk_elems,
        context={
            "bits": fmt.bits,
            "mask": (1 << fmt.bits) - 1,
            "group_size": fmt.group_size,
            "groups_per_row": in_features // fmt.group_size,
            "words_per_row": words_per_row,
            "chunk_words": chunk_words,
            "vec_words": vec_words,
            "chunk_elems": chunk_elems,
            "sub_elems": sub_elems,
            "subgroups": chunk_elems // sub_elems,
            "scale_t": scale_t,
        },
    )


FRAGMENTS: dict[str, Callable[[WeightFormat, int, int], Fragment]] = {
    "mlx_affine": _mlx_affine,
}


def fragment_for(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    try:
        make = FRAGMENTS[fmt.fragment]
    except KeyError:
        raise NotImplementedError(f"no device dequant fragment for {fmt.spell()} yet") from None
    return make(fmt, out_features, in_features)
