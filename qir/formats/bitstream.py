"""Row bitstreams of integer codes, shared by the integer formats (MLX affine, GPTQ, AWQ,
compressed-tensors int): element j of a row is a `bits`-wide code at bits [j*bits, (j+1)*bits)
of the row's little-endian uint32 words, so 3/5/6-bit codes straddle bytes and words.

This module is not a format (it registers nothing); `qir.formats` imports it like the others.
"""

from __future__ import annotations

import math

import numpy as np


def _group(bits: int) -> tuple[int, int]:
    """A group of the stream: its codes and its words (32 3-bit codes fill 3 words exactly;
    a code never straddles two groups), so every code of a row is a column operation."""
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


def unpack_codes(words: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """uint32 codes [O, in_features] from rows of little-endian `bits`-wide bitstreams."""
    words = np.ascontiguousarray(words, dtype="<u4")
    per, span = _group(bits)
    rows, n = words.shape
    if -(-in_features * bits // 32) > n:
        raise ValueError(f"{n} words of {bits}-bit codes hold fewer than {in_features} codes")
    if n % span:  # the row's last group, zero-filled
        words = np.concatenate([words, np.zeros((rows, span - n % span), words.dtype)], axis=1)
    blocks = words.reshape(rows, words.shape[1] // span, span)  # (-1 fails on 0 rows)
    codes = np.empty((rows, blocks.shape[1], per), np.uint32)
    mask = np.uint32((1 << bits) - 1)
    for j in range(per):
        k, s = divmod(j * bits, 32)
        code = blocks[:, :, k] >> np.uint32(s)
        if s + bits > 32:  # its high bits open the next word
            code |= blocks[:, :, k + 1] << np.uint32(32 - s)
        codes[:, :, j] = code & mask
    result: np.ndarray = codes.reshape(rows, blocks.shape[1] * per)[:, :in_features]
    return result


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of unpack_codes: uint32 words [O, ceil(I*bits/32)] (a code's bits above `bits`
    are dropped)."""
    per, span = _group(bits)
    rows, n = q.shape
    q = np.ascontiguousarray(q, dtype=np.uint32)
    if n % per:
        q = np.concatenate([q, np.zeros((rows, per - n % per), np.uint32)], axis=1)
    blocks = q.reshape(rows, q.shape[1] // per, per) & np.uint32((1 << bits) - 1)
    words = np.zeros((rows, blocks.shape[1], span), np.uint32)
    for j in range(per):
        k, s = divmod(j * bits, 32)
        words[:, :, k] |= blocks[:, :, j] << np.uint32(s)
        if s + bits > 32:
            words[:, :, k + 1] |= blocks[:, :, j] >> np.uint32(32 - s)
    flat = words.reshape(rows, blocks.shape[1] * span)
    return np.ascontiguousarray(flat[:, : -(-n * bits // 32)])
