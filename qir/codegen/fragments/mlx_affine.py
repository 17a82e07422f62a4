"""Fragment constants for MLX affine (templates/formats/mlx_affine.cuh.j2)."""

from __future__ import annotations

from qir.codegen.fragments import Fragment, bitstream_chunking, make_fragment, register_fragment
from qir.formats.base import WeightFormat
from qir.formats.mlx import MlxAffine


@register_fragment("mlx_affine")
def _mlx_affine(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, MlxAffine)
    chunking = bitstream_chunking(fmt.bits, in_features)
    chunk_elems = chunking["chunk_elems"]
    sub_elems = min(chunk_elems, fmt.group_size)
    scale_t = fmt.scale_dtype.c_type
    return make_fragment(
        "formats/mlx_affine.cuh.j2",
        {"weight": "uint32_t", "scales": scale_t, "biases": scale_t},
        chunk_elems,
        {
            **chunking,
            "group_size": fmt.group_size,
            "groups_per_row": in_features // fmt.group_size,
            "sub_elems": sub_elems,
            "subgroups": chunk_elems // sub_elems,
            "scale_t": scale_t,
        },
    )
