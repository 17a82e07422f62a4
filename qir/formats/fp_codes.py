"""Small-float codes shared by the FP weight formats (NVFP4, MXFP4, FP8): E2M1 and E4M3.

E2M1 (FP4): code `s<<3 | e<<1 | m`, codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their
negatives (8 is -0); no Inf/NaN. E4M3FN (FP8): bias 7, max 448, NaN 0x7F/0xFF, no Inf.
Encoding goes through ml_dtypes, whose casts round to nearest even like ModelOpt, compressed-tensors
and vLLM; both encoders saturate, because ml_dtypes turns an out-of-range E4M3 value into NaN while
every producer clamps to 448 first.

This module is not a format (it registers nothing); `qir.formats` imports it like the others.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Index = 4-bit code.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# E4M3FN NaN codes (S.1111.111); a scale holding one of them poisons its whole block.
E4M3_NAN_CODES = (0x7F, 0xFF)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """float32 values of 4-bit E2M1 codes (any integer array; only the low nibble is read)."""
    result: np.ndarray = E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]
    return result


def e2m1_encode_rne(x: np.ndarray) -> np.ndarray:
    """uint8 E2M1 codes of float values: round to nearest even, saturating at +-6; -0 stays 0x8."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E2M1_MAX, E2M1_MAX)
    return x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def unpack_fp4(packed: np.ndarray, n: int) -> np.ndarray:
    """uint8 codes [..., n] from bytes [..., n/2]: element 2k is the low nibble of byte k."""
    p = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    if codes.shape[-1] != n:
        raise ValueError(f"unpack_fp4: {p.shape[-1]} bytes per row hold {codes.shape[-1]}, not {n}")
    return codes


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Inverse of unpack_fp4: bytes [..., n/2] of uint8 codes [..., n] (n even)."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_fp4: odd number of codes per row ({c.shape[-1]})")
    return np.ascontiguousarray((c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4))


def e4m3_decode(u8: np.ndarray) -> np.ndarray:
    """float32 values of E4M3FN bytes (uint8 or float8_e4m3fn arrays); NaN codes give NaN."""
    a = np.asarray(u8)
    if a.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        a = a.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return a.astype(np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """uint8 E4M3FN codes of float values: round to nearest even, saturating at +-448."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
