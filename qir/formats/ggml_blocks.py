"""ggml's quantized blocks in numpy: each linear type's raw blocks parsed into fields and written
back, the decode, and a round-to-nearest encoder (layouts: llama.cpp's ggml-common.h; facts in
docs/gguf.md, Types).

Fields are what every linear type shares:
  q    uint8 [..., K]       one code per element, the whole code (low bits, then the high bits
                            the type keeps apart); Q8_0's int8 stored offset-binary (x ^ 0x80)
  d    float16 [..., K/b]   the block's scale
  dmin float16 [..., K/b]   Q4_1/Q5_1's m (added), the K-quants' min scale (times mn, subtracted)
  sc   int16 [..., K/r]     the sub-block's integer scale, signed as it multiplies (Q3_K's and
                            IQ4_XS's 6-bit fields less 32, Q6_K's int8)
  mn   int16 [..., K/r]     the sub-block's integer min (Q2_K, Q4_K, Q5_K)
A weight is `value(q) * S + B` in float32 with S = d * sc (d where there are no sub-scales) and
B = m or -(dmin * mn): value(q) is q - zero, or the type's table entry (IQ4). Every product is
exact in float32 (an fp16 scale times a 6-bit sub-scale times a code of at most 8 bits fits 24
bits), so only the add rounds, once, as in gguf-py's dequantize and ggml's C `to_float`: the
decode is theirs bit for bit, whatever order they multiply in.

The encoder is a plain round-to-nearest from each block's extremes (for the legacy types the
same rule as ggml's reference quantizers); llama.cpp's error-searching K- and IQ-quantizers are
not reproduced: real blocks come from GGUF files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# IQ4_NL / IQ4_XS code values (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class Spec:
    """A linear type's block structure."""

    name: str
    block: int  # elements per block (one d, dmin)
    block_bytes: int
    run: int  # elements per sub-block (= block where there are no sub-scales)
    bits: int  # bits of a code
    zero: int  # value(q) = q - zero (types without a table)
    table: tuple[int, ...] | None = None  # value(q) = table[q]
    mins: str = ""  # "m": B = m per block; "dmin": B = -(dmin * mn) per sub-block
    sub: str = ""  # "", "sc" (a signed sub-scale), "sc_mn" (a scale and a min)


SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("Q4_0", 32, 18, 32, 4, 8),
        Spec("Q4_1", 32, 20, 32, 4, 0, mins="m"),
        Spec("Q5_0", 32, 22, 32, 5, 16),
        Spec("Q5_1", 32, 24, 32, 5, 0, mins="m"),
        Spec("Q8_0", 32, 34, 32, 8, 128),
        Spec("Q2_K", 256, 84, 16, 2, 0, mins="dmin", sub="sc_mn"),
        Spec("Q3_K", 256, 110, 16, 3, 4, sub="sc"),
        Spec("Q4_K", 256, 144, 32, 4, 0, mins="dmin", sub="sc_mn"),
        Spec("Q5_K", 256, 176, 32, 5, 0, mins="dmin", sub="sc_mn"),
        Spec("Q6_K", 256, 210, 16, 6, 32, sub="sc"),
        Spec("IQ4_NL", 32, 18, 32, 4, 0, table=IQ4_VALUES),
        Spec("IQ4_XS", 256, 136, 32, 4, 0, table=IQ4_VALUES, sub="sc"),
        Spec("TQ1_0", 256, 54, 256, 2, 1),
        Spec("TQ2_0", 256, 66, 256, 2, 1),
    )
}


@dataclass(frozen=True)
class Fields:
    q: np.ndarray
    d: np.ndarray
    dmin: np.ndarray | None = None
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None


def values(spec: Spec, q: np.ndarray) -> np.ndarray:
    """float32 value(q) of codes q."""
    if spec.table is not None:
        result: np.ndarray = np.asarray(spec.table, dtype=np.float32)[q]
        return result
    return q.astype(np.float32) - np.float32(spec.zero)


def _per_element(a: np.ndarray, n: int) -> np.ndarray:
    return np.repeat(a, n, axis=-1)


def decode(spec: Spec, f: Fields) -> np.ndarray:
    """float32 [..., K] weights of the fields, as gguf-py decodes the same blocks."""
    d = f.d.astype(np.float32)
    s = d if f.sc is None else _per_element(d, spec.block // spec.run) * f.sc.astype(np.float32)
    w = values(spec, f.q) * _per_element(s, spec.run)
    if spec.mins == "m":
        assert f.dmin is not None
        w = w + _per_element(f.dmin.astype(np.float32), spec.block)
    elif spec.mins == "dmin":
        assert f.dmin is not None and f.mn is not None
        dmin = _per_element(f.dmin.astype(np.float32), spec.block // spec.run)
        w = w - _per_element(dmin * f.mn.astype(np.float32), spec.run)
    result: np.ndarray = w
    return result


# ---- raw blocks <-> fields ------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 [..., nb] of two bytes [..., nb, 2] (little-endian)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")[..., None]).view(np.uint8)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")[..., 0].astype(np.uint32)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """Codes [..., 2n] of bytes [..., n]: low nibbles first, then the high ones (Q4_0 order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _halves_nibbles(q: np.ndarray) -> np.ndarray:
    n = q.shape[-1] // 2
    return (q[..., :n] & 15) | (q[..., n:] << 4)


def _bits_of_u32(h: np.ndarray, n: int) -> np.ndarray:
    """Bit j of each uint32 [...] for j < n, as uint8 [..., n]."""
    return ((h[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _u32_of_bits(bits: np.ndarray) -> np.ndarray:
    shifted = bits.astype(np.uint32) << np.arange(bits.shape[-1], dtype=np.uint32)
    result: np.ndarray = shifted.sum(axis=-1, dtype=np.uint32)
    return result


def _crumbs(qs: np.ndarray, shifts: int) -> np.ndarray:
    """Q2_K's traversal: per 32 bytes, `shifts` fields of 8 / shifts bits, 32 elements each."""
    width = 8 // shifts
    lead = qs.shape[:-1]
    x = qs.reshape(*lead, -1, 1, 32) >> (np.arange(shifts, dtype=np.uint8) * width)[:, None]
    return (x & ((1 << width) - 1)).reshape(*lead, -1)


def _uncrumbs(q: np.ndarray, shifts: int) -> np.ndarray:
    width = 8 // shifts
    lead = q.shape[:-1]
    x = q.reshape(*lead, -1, shifts, 32).astype(np.uint8)
    x = x << (np.arange(shifts, dtype=np.uint8) * width)[:, None]
    result: np.ndarray = np.bitwise_or.reduce(x, axis=-2).reshape(*lead, -1)
    return result


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 6-bit scales and mins of 12 bytes (get_scale_min_k4)."""
    lo = s[..., :4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo[0] & 63, (lo[2] & 15) | ((lo[0] >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo[1] & 63, (lo[2] >> 4) | ((lo[1] >> 6) << 4)], axis=-1)
    return sc, mn


def _k4_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    a = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1)


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 16 6-bit scales of 12 bytes, less 32: low nibbles of bytes i % 8 (byte i's low
    nibble for i < 8, high for i >= 8), two high bits from byte 8 + i % 4 at bits 2 * (i // 4)."""
    i = np.arange(16)
    low = (s[..., i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 15
    high = (s[..., 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.int16) - 32


def _q3_scale_bytes(sc: np.ndarray) -> np.ndarray:
    u = (sc + 32).astype(np.uint8)
    out = np.zeros((*u.shape[:-1], 12), np.uint8)
    for i in range(16):
        out[..., i % 8] |= (u[..., i] & 15) << (4 * (i // 8))
        out[..., 8 + i % 4] |= (u[..., i] >> 4) << (2 * (i // 4))
    return out


_TRITS = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits(b: np.ndarray, n: int, width: int) -> np.ndarray:
    """TQ1_0: bytes [..., width] holding n trits each (byte * 3^k, mod 256, times 3, >> 8),
    trit k of byte l being element k * width + l."""
    lead = b.shape[:-1]
    x = (b[..., None, :] * _TRITS[:n, None]).astype(np.uint8)
    return ((x.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(*lead, n * width)


def _trit_bytes(q: np.ndarray, n: int, width: int) -> np.ndarray:
    lead = q.shape[:-1]
    x = q.reshape(*lead, n, width).astype(np.uint16)
    v = (x * _TRITS[:n][::-1, None].astype(np.uint16)).sum(axis=-2) * (3 ** (5 - n))
    # ceil(v * 256 / 243): the byte whose first trit reads back as the most significant one
    result: np.ndarray = ((v * 256 + 242) // 243).astype(np.uint8)
    return result


def parse(spec: Spec, raw: np.ndarray) -> Fields:
    """Fields of raw blocks uint8 [..., nb * block_bytes]."""
    raw = np.asarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    b = raw.reshape(*lead, -1, spec.block_bytes)
    n = spec.name

    def flat(q: np.ndarray) -> np.ndarray:
        return q.reshape(*lead, -1).astype(np.uint8)

    if n in ("Q4_0", "IQ4_NL"):
        return Fields(flat(_nibbles_halves(b[..., 2:18])), _f16(b[..., 0:2]))
    if n == "Q4_1":
        return Fields(flat(_nibbles_halves(b[..., 4:20])), _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    if n in ("Q5_0", "Q5_1"):
        at = 4 if n == "Q5_1" else 2
        hb = _bits_of_u32(_u32(b[..., at : at + 4]), 32)
        q = _nibbles_halves(b[..., at + 4 : at + 20]) | (hb << 4)
        return Fields(flat(q), _f16(b[..., 0:2]), _f16(b[..., 2:4]) if n == "Q5_1" else None)
    if n == "Q8_0":
        return Fields(flat(b[..., 2:34] ^ 0x80), _f16(b[..., 0:2]))
    if n == "Q2_K":
        s = b[..., 0:16]
        q = _crumbs(b[..., 16:80], 4)
        mn = (s >> 4).astype(np.int16)
        return Fields(flat(q), _f16(b[..., 80:82]), _f16(b[..., 82:84]), flat_i(s & 15), flat_i(mn))
    if n == "Q3_K":
        hb = (b[..., 0:32, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., l, k]
        hb = np.swapaxes(hb, -1, -2).reshape(*b.shape[:-1], 256)  # element 32k + l
        q = _crumbs(b[..., 32:96], 4) | (hb << 2)
        return Fields(flat(q), _f16(b[..., 108:110]), sc=flat_i(_q3_scales(b[..., 96:108])))
    if n in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales(b[..., 4:16])
        at = 16 if n == "Q4_K" else 48
        q = b[..., at : at + 128].reshape(*b.shape[:-1], 4, 1, 32) >> np.array([[0], [4]], np.uint8)
        q = (q & 15).reshape(*b.shape[:-1], 256)
        if n == "Q5_K":
            hb = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
            q = q | (np.swapaxes(hb, -1, -2).reshape(*b.shape[:-1], 256) << 4)
        return Fields(flat(q), _f16(b[..., 0:2]), _f16(b[..., 2:4]), flat_i(sc), flat_i(mn))
    if n == "Q6_K":
        lo = b[..., 0:128].reshape(*b.shape[:-1], 2, 1, 64) >> np.array([[0], [4]], np.uint8)
        lo = (lo & 15).reshape(*b.shape[:-1], 256)
        hi = _crumbs(b[..., 128:192], 4)
        sc = b[..., 192:208].view(np.int8).astype(np.int16)
        return Fields(flat(lo | (hi << 4)), _f16(b[..., 208:210]), sc=flat_i(sc))
    if n == "IQ4_XS":
        sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0]
        ib = np.arange(8)
        low = (b[..., 4 + ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15
        high = (sh[..., None] >> (2 * ib).astype(np.uint16)) & 3
        sc = (low | (high << 4)).astype(np.int16) - 32
        q = b[..., 8:136].reshape(*b.shape[:-1], 8, 1, 16) >> np.array([[0], [4]], np.uint8)
        return Fields(flat((q & 15).reshape(*b.shape[:-1], 256)), _f16(b[..., 0:2]), sc=flat_i(sc))
    if n == "TQ2_0":
        return Fields(flat(_crumbs(b[..., 0:64], 4)), _f16(b[..., 64:66]))
    if n == "TQ1_0":
        q = np.concatenate(
            [
                _trits(b[..., 0:32], 5, 32),
                _trits(b[..., 32:48], 5, 16),
                _trits(b[..., 48:52], 4, 4),
            ],
            axis=-1,
        )
        return Fields(flat(q), _f16(b[..., 52:54]))
    raise ValueError(f"no block parser for {n}")


def flat_i(x: np.ndarray) -> np.ndarray:
    """Per-block fields [..., nb, k] as one row [..., nb * k] of int16."""
    return x.reshape(*x.shape[:-2], -1).astype(np.int16)


def unparse(spec: Spec, f: Fields) -> np.ndarray:
    """Raw blocks uint8 [..., nb * block_bytes] of fields (the inverse of parse)."""
    n = spec.name
    lead = f.q.shape[:-1]
    nb = f.q.shape[-1] // spec.block
    q = f.q.reshape(*lead, nb, spec.block).astype(np.uint8)

    def per_block(x: np.ndarray | None) -> np.ndarray:
        assert x is not None
        return x.reshape(*lead, nb, -1)

    d = _f16_bytes(f.d)
    if n in ("Q4_0", "IQ4_NL"):
        parts = [d, _halves_nibbles(q)]
    elif n == "Q4_1":
        parts = [d, _f16_bytes(per_block(f.dmin)[..., 0]), _halves_nibbles(q)]
    elif n in ("Q5_0", "Q5_1"):
        qh = _u32_of_bits(q >> 4)[..., None].astype("<u4").view(np.uint8)
        m = [_f16_bytes(per_block(f.dmin)[..., 0])] if n == "Q5_1" else []
        parts = [d, *m, qh, _halves_nibbles(q & 15)]
    elif n == "Q8_0":
        parts = [d, q ^ 0x80]
    elif n == "Q2_K":
        s = (per_block(f.sc) | (per_block(f.mn) << 4)).astype(np.uint8)
        parts = [s, _uncrumbs(q, 4), d, _f16_bytes(per_block(f.dmin)[..., 0])]
    elif n == "Q3_K":
        hb = np.swapaxes(((q >> 2) & 1).reshape(*lead, nb, 8, 32), -1, -2)
        hmask = (hb << np.arange(8, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)
        parts = [hmask, _uncrumbs(q & 3, 4), _q3_scale_bytes(per_block(f.sc)), d]
    elif n in ("Q4_K", "Q5_K"):
        lo = (q & 15).reshape(*lead, nb, 4, 2, 32)
        qs = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(*lead, nb, 128)
        dm = [
            d,
            _f16_bytes(per_block(f.dmin)[..., 0]),
            _k4_scale_bytes(per_block(f.sc), per_block(f.mn)),
        ]
        if n == "Q5_K":
            hb = np.swapaxes((q >> 4).reshape(*lead, nb, 8, 32), -1, -2)
            dm.append((hb << np.arange(8, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8))
        parts = [*dm, qs]
    elif n == "Q6_K":
        lo = (q & 15).reshape(*lead, nb, 2, 2, 64)
        ql = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(*lead, nb, 128)
        sc = per_block(f.sc).astype(np.int8).view(np.uint8)
        parts = [ql, _uncrumbs(q >> 4, 4), sc, d]
    elif n == "IQ4_XS":
        u = (per_block(f.sc) + 32).astype(np.uint16)
        sh = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
        sl = ((u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)).astype(np.uint8)
        q4 = q.reshape(*lead, nb, 8, 2, 16)
        qs = (q4[..., 0, :] | (q4[..., 1, :] << 4)).reshape(*lead, nb, 128)
        parts = [d, sh[..., None].astype("<u2").view(np.uint8), sl, qs]
    elif n == "TQ2_0":
        parts = [_uncrumbs(q, 4), d]
    elif n == "TQ1_0":
        parts = [
            _trit_bytes(q[..., :160], 5, 32),
            _trit_bytes(q[..., 160:240], 5, 16),
            _trit_bytes(q[..., 240:], 4, 4),
            d,
        ]
    else:
        raise ValueError(f"no block writer for {n}")
    return np.concatenate(parts, axis=-1).reshape(*lead, nb * spec.block_bytes)


# ---- round-to-nearest encoder -----------------------------------------------------------------


def _signed_max(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude of each block [..., n] (ggml's `max` for Q4_0/Q5_0)."""
    i = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, i, axis=-1)[..., 0]


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _nearest(table: tuple[int, ...], v: np.ndarray) -> np.ndarray:
    t = np.asarray(table, dtype=np.float32)
    result: np.ndarray = np.abs(v[..., None] - t).argmin(axis=-1).astype(np.uint8)
    return result


def _round_half_away(x: np.ndarray) -> np.ndarray:
    result: np.ndarray = np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))
    return result


def encode(spec: Spec, w: np.ndarray) -> Fields:
    """Fields of float32 weights [..., K] (K a multiple of spec.block)."""
    w = np.asarray(w, dtype=np.float32)
    lead = w.shape[:-1]
    blocks = w.reshape(*lead, -1, spec.block)
    if spec.sub == "":
        return _encode_flat(spec, blocks)
    return _encode_two_level(spec, blocks)


def _encode_flat(spec: Spec, x: np.ndarray) -> Fields:
    lead = x.shape[:-2]
    levels = (1 << spec.bits) - 1

    def done(q: np.ndarray, d: np.ndarray, dmin: np.ndarray | None = None) -> Fields:
        d16 = d.astype(np.float16)
        return Fields(
            q.reshape(*lead, -1).astype(np.uint8),
            d16,
            None if dmin is None else dmin.astype(np.float16),
        )

    if spec.mins == "m":  # Q4_1, Q5_1: d = (max - min) / levels, m = min
        lo, hi = x.min(axis=-1), x.max(axis=-1)
        d = ((hi - lo) / np.float32(levels)).astype(np.float32)
        q = np.trunc((x - lo[..., None]) * _inv(d)[..., None] + np.float32(0.5))
        return done(np.clip(q, 0, levels), d, lo)
    if spec.table is not None:  # IQ4_NL: the block's extreme on the table's end
        d = (_signed_max(x) / np.float32(spec.table[0])).astype(np.float32)
        d32 = d.astype(np.float16).astype(np.float32)
        return done(_nearest(spec.table, x * _inv(d32)[..., None]), d)
    if spec.name == "Q8_0":
        d = (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float32)
        q = _round_half_away(x * _inv(d)[..., None]) + 128
        return done(q, d)
    if spec.name in ("TQ1_0", "TQ2_0"):
        d = np.abs(x).max(axis=-1).astype(np.float32)
        return done(np.clip(_round_half_away(x * _inv(d)[..., None]) + 1, 0, 2), d)
    # Q4_0, Q5_0: the block's extreme lands on code 0, the others round from zero + 0.5
    d = (_signed_max(x) / np.float32(-spec.zero)).astype(np.float32)
    q = np.trunc(x * _inv(d)[..., None] + np.float32(spec.zero + 0.5))
    return done(np.clip(q, 0, levels), d)


def _encode_two_level(spec: Spec, x: np.ndarray) -> Fields:
    lead = x.shape[:-2]
    nb = x.shape[-2]
    subs = x.reshape(*lead, nb, spec.block // spec.run, spec.run)
    levels = (1 << spec.bits) - 1
    sub_bits = 4 if spec.name == "Q2_K" else 6
    if spec.mins == "dmin":  # Q2_K, Q4_K, Q5_K: w = d*sc*q - dmin*mn, sc and mn unsigned
        mn_f = np.maximum(-subs.min(axis=-1), 0)
        s_f = (subs.max(axis=-1) + mn_f) / np.float32(levels)
        top = np.float32((1 << sub_bits) - 1)
        d = (s_f.max(axis=-1) / top).astype(np.float16)
        dmin = (mn_f.max(axis=-1) / top).astype(np.float16)
        sc = np.clip(np.rint(s_f * _inv(d.astype(np.float32))[..., None]), 0, top)
        mn = np.clip(np.rint(mn_f * _inv(dmin.astype(np.float32))[..., None]), 0, top)
        s = d.astype(np.float32)[..., None] * sc
        b = dmin.astype(np.float32)[..., None] * mn
        q = np.rint((subs + b[..., None]) * _inv(s)[..., None])
        q = np.clip(q, 0, levels)
    else:  # Q3_K, Q6_K, IQ4_XS: w = d*sc*value(q), sc signed
        end = spec.table[0] if spec.table is not None else -spec.zero
        s_f = _signed_max(subs) / np.float32(end)
        stop = 127 if spec.name == "Q6_K" else 31
        d = (np.abs(s_f).max(axis=-1) / np.float32(stop)).astype(np.float16)
        sc = np.clip(np.rint(s_f * _inv(d.astype(np.float32))[..., None]), -stop - 1, stop)
        s = d.astype(np.float32)[..., None] * sc
        v = subs * _inv(s)[..., None]
        if spec.table is not None:
            q = _nearest(spec.table, v)
        else:
            q = np.clip(np.rint(v) + spec.zero, 0, levels)
        dmin, mn = None, None
    return Fields(
        q.reshape(*lead, -1).astype(np.uint8),
        d,
        dmin,
        sc.reshape(*lead, -1).astype(np.int16),
        None if mn is None else mn.reshape(*lead, -1).astype(np.int16),
    )
