"""Fragment constants for MLX affine (templates/formats/mlx_affine.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import MAX_CHUNK_ELEMS, Fragment, register_fragment
from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat
from qir.formats.mlx import MlxAffine


@register_fragment("mlx_affine")
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
