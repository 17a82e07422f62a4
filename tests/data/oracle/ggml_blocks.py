"""Real ggml blocks for the GGUF weight formats (tests/data/ggml_blocks): every type qir reads,
quantized and decoded by llama.cpp's own C library, so the tests need neither llama.cpp nor
its Python binding.

    python ggml_blocks.py OUT_DIR      (venv: llama-cpp-python 0.3.36 built from source, numpy)

ggml's C functions through ctypes from the binding's bundled `libggml-base.so`:
`ggml_quantize_chunk(type, src, dst, 0, rows, n_per_row, NULL)` (no importance matrix: none of
these types needs one) writes the blocks, `ggml_get_type_traits(type)->to_float` decodes them.

The input (`x`, float32 [5, 512]: two 256-blocks, sixteen 32-blocks a row) has rows that reach
the decoders' edges: N(0, 1); N(0, 1) with each 32-block scaled by 2^U(-12, 12) (scales and
mins over a wide range, sub-blocks of one 256-block far apart); N(0, 1) with a quarter of the
values zeroed, one outlier of 40 per 64 and a block of constants; N(0, 1) * 1e-6 (fp16 block
scales below 2^-14: subnormal); all positive N(0,1)^2 (minimum codes 0 everywhere, the min
terms of Q4_1/Q5_1/K-quants at their largest).

OUT_DIR/blocks.npz: `x`, and per type name T `T.raw` (uint8 [5, row bytes], the blocks as a
GGUF stores a [5, 512] tensor's rows) and `T.decoded` (float32 [5, 512], C's to_float of them).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import llama_cpp
import numpy as np

TYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "IQ4_NL": 20,
    "IQ4_XS": 23,
    "TQ1_0": 34,
    "TQ2_0": 35,
    "MXFP4": 39,
}
K = 512


class Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def inputs() -> np.ndarray:
    rng = np.random.default_rng(32)
    x = rng.standard_normal((5, K)).astype(np.float32)
    x[1] *= np.repeat(2.0 ** rng.uniform(-12, 12, K // 32), 32).astype(np.float32)
    x[2, rng.random(K) < 0.25] = 0
    x[2, ::64] = 40
    x[2, 64:96] = 0.5
    x[3] *= np.float32(1e-6)
    x[4] = x[4] ** 2
    return x


def main(out: Path) -> None:
    lib = library()
    x = inputs()
    rows, n = x.shape
    arrays: dict[str, np.ndarray] = {"x": x}
    for name, t in TYPES.items():
        traits = lib.ggml_get_type_traits(t).contents
        assert traits.type_name.decode().lower() == name.lower(), traits.type_name
        assert not lib.ggml_quantize_requires_imatrix(t), name
        row_bytes = n // traits.blck_size * traits.type_size
        raw = np.zeros((rows, row_bytes), np.uint8)
        src = np.ascontiguousarray(x)
        size = lib.ggml_quantize_chunk(t, src.ctypes.data, raw.ctypes.data, 0, rows, n, None)
        assert size == raw.size, (name, size, raw.size)
        decoded = np.zeros((rows, n), np.float32)
        to_float = TO_FLOAT(traits.to_float)
        to_float(raw.ctypes.data, decoded.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows * n)
        arrays[f"{name}.raw"] = raw
        arrays[f"{name}.decoded"] = decoded
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "blocks.npz", **arrays)
    print(
        f"wrote {out / 'blocks.npz'}: {len(TYPES)} types, llama-cpp-python {llama_cpp.__version__}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
