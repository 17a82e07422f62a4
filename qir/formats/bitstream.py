"""Row bitstreams of integer codes, shared by the integer formats (MLX affine, GPTQ, AWQ,
compressed-tensors int): element j of a row is a `bits`-wide code at bits [j*bits, (j+1)*bits)
of the row's little-endian uint32 words, so 3/5/6-bit codes straddle bytes and words.

This module is not a format (it registers nothing); `qir.formats` imports it like the others.
"""

from __future__ import annotations

import numpy as np


def unpack_codes(words: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """uint32 codes [O, in_features] from rows of little-endian `bits`-wide bitstreams."""
    words = np.ascontiguousarray(words, dtype="<u4").astype(np.uint64)
    # A code may straddle two words: read each code from the 64-bit pair (word k, word k+1).
    padded = np.concatenate([words, np.zeros((words.shape[0], 1), np.uint64)], axis=1)
    start = np.arange(in_features, dtype=np.uint64) * np.uint64(bits)
    k = (start // np.uint64(32)).astype(np.intp)
    pair = padded[:, k] | (padded[:, k + 1] << np.uint64(32))
    mask = np.uint64((1 << bits) - 1)
    result: np.ndarray = ((pair >> (start % np.uint64(32))) & mask).astype(np.uint32)
    return result


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of unpack_codes: uint32 words [O, I*bits/32]."""
    rows = q.shape[0]
    bit_planes = (q[..., None] >> np.arange(bits, dtype=np.uint32)) & 1
    packed = np.packbits(bit_planes.astype(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)
