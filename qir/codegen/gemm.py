"""The tensor-core GEMM family (prefill and batched serving)."""

from __future__ import annotations

from functools import cache

from qir.codegen.render import TEMPLATES

MMA_HEADER = "qir_mma.cuh"


@cache
def mma_header() -> tuple[str, str]:
    """The header of the mma / ldmatrix / cp.async helpers, as a (file name, text) pair."""
    return MMA_HEADER, (TEMPLATES / MMA_HEADER).read_text()
