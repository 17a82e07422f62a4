r"""ggml's (GGUF's) linear tensor types as one weight format, `ggml<type=Q4_K>`: the legacy
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the non-linear IQ4_NL and IQ4_XS, and the
ternary TQ1_0 / TQ2_0; each decodes as gguf-py (and ggml's C) decodes it, bit for bit
(qir.formats.ggml_blocks). ggml's MXFP4 becomes qir's `mxfp4` (its nibbles reordered); the
codebook types (IQ1_S, IQ1_M, IQ2_*, IQ3_*) are refused by the ggml_types registry.

Kernel layout: each row's blocks are split once at load into planes; the codes' low bits are
the `weight` buffer, the rest of a row's planes lie one after another in `fields` (its rows
padded to 16 bytes, so that every row starts aligned), each plane a whole number of chunks'
worth where its chunks are read (RowLayout has the sizes):

| buffer | plane | holds |
|---|---|---|
| weight (u32 [O, K*L/32]) | codes | the low L bits of every code (L = 4; 2 for Q2_K, Q3_K, TQ; 8 for Q8_0) as little-endian 32-bit words (code_word: the 4-bit row is a plain bitstream) |
| fields (u8 [O, R]) | high | the other H bits (Q5_*: 1, Q6_K: 2, Q3_K: 1), tiled for the decoder (high_tiling) |

Q6_K is the exception: its 6-bit codes lie whole in 16-code groups of three words (Q6_PAIRS),
two of each group's in `weight` and one in `high` (the planes' sizes as above), so that most
pairs need one mask and no merge.
| | scales | the legacy types: each block's fp16 d (then its m, interleaved); the K-quants and IQ4_XS: first each sub-block's scale (and min) byte: Q4_K/Q5_K (sc, mn), Q2_K sc \| mn << 4, Q3_K/IQ4_XS the 6-bit field less 32, Q6_K its int8 (two's complement); then each block's d (and dmin, interleaved) as fp16 |

Why planes and not the blocks as stored: a block is 18..210 bytes, so most blocks start at
2-byte offsets and their code bytes cannot be read with aligned 16-byte loads, and each
block's fields sit at different offsets of it; in planes a chunk's codes are one aligned
16-byte load and its scales one small load, and the codes take the bitstream order the
magic-number decode of the other integer formats reads cheapest (4-bit fields at bit 0 and 16
of a word form a pair). Why two buffers and not one per plane: a warp streams 4 rows at a time,
and two pointers per row instead of up to four leave the decoder the registers it needs (Q5_K's
paired GEMV spilled on sm_100a with three). A row is still a byte slice of both (row splits,
q/k/v splits); a K split on block boundaries is rebuilt (columns). The planes cost what
the blocks cost (and up to 15 bytes of padding a row), but for the K-quants' sub-scales:
Q4_K's and Q5_K's 6-bit (scale, min) pairs take a byte each (16 bytes a super-block where ggml
packs 12: 148 bytes a 256-block instead of 144, Q5_K 180 for 176), Q3_K's 6-bit scales a byte
(114 for 110), IQ4_XS's a byte (138 for 136): a chunk then finds its sub-scale at a fixed
offset, where the packed form would cost a dozen bit operations on a run-time index per chunk.
TQ1_0's base-3 bytes are repacked into TQ2_0's 2-bit codes (66 bytes a block for 54: ternary
digits have no bit-field decode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, ClassVar

import numpy as np

from qir.dtypes import U8, U32
from qir.formats.base import (
    Allowed,
    FormatError,
    ParamTable,
    WeightFormat,
    check_tensor,
    refuse_codes,
)
from qir.formats.ggml_blocks import SPECS, Fields, Spec, decode, encode, parse
from qir.formats.ggml_types import TYPES, GgmlReader, register_ggml
from qir.formats.mx import E8M0_NAN, Mxfp4
from qir.formats.registry import register
from qir.types import TensorType


def lo_bits(spec: Spec) -> int:
    """Bits of a code kept in `weight`."""
    return 8 if spec.bits == 8 else 4 if spec.bits >= 4 else 2


def hi_bits(spec: Spec) -> int:
    return spec.bits - lo_bits(spec)


def sub_bytes(spec: Spec) -> int:
    """Bytes of a sub-block's scale (and min) in `scales`."""
    if not spec.sub:
        return 0
    return 2 if spec.sub == "sc_mn" and spec.name != "Q2_K" else 1


def record_bytes(spec: Spec) -> int:
    """Bytes of a block's scales where it has sub-blocks: d (and dmin) as fp16 and the
    sub-blocks' scale (and min) bytes."""
    return 2 * (2 if spec.mins else 1) + spec.block // spec.run * sub_bytes(spec)


@dataclass(frozen=True)
class RowLayout:
    """A row's bytes in each buffer: `weight` holds the codes' low bits, `fields` the high
    bits, then the scales (its length padded to 16: every row starts 16-byte aligned)."""

    codes: int
    high: int
    scales: int

    @property
    def scales_at(self) -> int:
        return self.high

    @property
    def fields(self) -> int:
        return -(-(self.high + self.scales) // 16) * 16


def row_layout(spec: Spec, in_features: int) -> RowLayout:
    k, blocks = in_features, in_features // spec.block
    scales = blocks * (record_bytes(spec) if spec.sub else 2 * (2 if spec.mins else 1))
    return RowLayout(k * lo_bits(spec) // 8, k * hi_bits(spec) // 8, scales)


@dataclass(frozen=True)
class CodeWord:
    """How a 32-bit word of `weight` holds its codes' low bits: as pairs, pair p holding
    elements (lo[p], lo[p] + 4) at bits (field[p], field[p] + 16), the f16 pair the
    magic-number decode reads; a step is 4 pairs, 8 consecutive elements (units of 4, stride 4),
    and the decoder shifts the word once per step (`shift`), after which the step's fields sit
    at field - shift, inside f16's unit-1 window."""

    lo: tuple[int, ...]
    field: tuple[int, ...]
    shift: tuple[int, ...]

    @property
    def elems(self) -> int:
        return 2 * len(self.lo)

    def bit_of_element(self) -> tuple[int, ...]:
        bits = [0] * self.elems
        for e, f in zip(self.lo, self.field, strict=True):
            bits[e], bits[e + 4] = f, f + 16
        return tuple(bits)


def code_word(lo: int) -> CodeWord:
    """4-bit: the row's plain bitstream (elements e, e + 4 at bits 4e, 4e + 16; the step's
    pairs 2 and 3 after a shift of 8). 2-bit: two steps a word, step s's pairs at bits 8s + 2e
    and 8s + 2e + 16 (e < 4), so that a step is 8 elements like the other widths' (not the
    plain bitstream's 16, whose pairs (e, e + 8) would halve the GEMV's rows per warp)."""
    if lo == 4:
        return CodeWord((0, 1, 2, 3), (0, 4, 8, 12), (0, 0, 8, 8))
    assert lo == 2, lo
    return CodeWord(
        tuple(8 * s + e for s in (0, 1) for e in range(4)),
        tuple(8 * s + 2 * e for s in (0, 1) for e in range(4)),
        (0, 0, 0, 0, 8, 8, 8, 8),
    )


@cache
def high_tiling(lo: int, hi: int) -> tuple[int, tuple[int, ...]]:
    """(elements per word of `high`, the bit of each one's first high bit in its word; its
    other high bits follow, modulo 32).

    The decoder ORs each code's high bits in right above its low ones, after its word's
    shift (code_word): a group of pairs read after one shift has its high bits in one word of
    `high` at a common rotation from where they go, so that one rotation of that word serves
    the group, and the first group of a word needs none. The rotations are the smallest from
    there that tile the 32 bits (5-bit: 0-3 and 8-11, one word per 32 codes; 6-bit: 0, 2, 8,
    10 per 16 codes; Q3_K's 3-bit: 0, 1, 8, 9 per 32)."""
    cw = code_word(lo)
    by_shift: dict[int, list[int]] = {}
    for p, sh in enumerate(cw.shift):
        by_shift.setdefault(sh, []).append(p)
    groups = list(by_shift.items())
    # where a group's bits go, relative to its first field: lo bits above each field, +16
    rel = [
        {cw.field[p] - sh + lo + k + h for p in ps for k in range(hi) for h in (0, 16)}
        for sh, ps in groups
    ]
    rotations: list[int] = []
    used: set[int] = set()
    while len(used) < 32:
        g = len(rotations) % len(groups)
        r = next((r for r in range(32) if not {(x + r) % 32 for x in rel[g]} & used), None)
        assert r is not None, (lo, hi)
        rotations.append(r)
        used |= {(x + r) % 32 for x in rel[g]}
    words = len(rotations) // len(groups)
    pos = [0] * (words * cw.elems)
    for t in range(words):
        for g, (sh, ps) in enumerate(groups):
            for p in ps:
                bit = (rotations[t * len(groups) + g] + cw.field[p] - sh + lo) % 32
                pos[t * cw.elems + cw.lo[p]] = bit
                pos[t * cw.elems + cw.lo[p] + 4] = (bit + 16) % 32
    return len(pos), tuple(pos)


def _pack_high(h: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """uint32 [..., K*hi/32] of the high bits h [..., K] (high_tiling)."""
    pos = high_tiling(lo, hi)[1]
    planes = [_pack_bits((h >> k) & 1, tuple((b + k) % 32 for b in pos)) for k in range(hi)]
    result: np.ndarray = np.bitwise_or.reduce(planes, axis=0)
    return result


def _unpack_high(words: np.ndarray, lo: int, hi: int) -> np.ndarray:
    pos = high_tiling(lo, hi)[1]
    bits = [_unpack_bits(words, tuple((b + k) % 32 for b in pos), 1) << k for k in range(hi)]
    result: np.ndarray = np.bitwise_or.reduce(bits, axis=0).astype(np.uint8)
    return result


# Q6_K's 6-bit codes, a group of 16 (two steps) in three words X0, X1, X2 (X0 X1 of a chunk's
# groups in `weight`, X2 in `high`): per pair of the group, the parts of its low element's code
# (word, bit in the word, bit of the code, bits); its high element's sit 16 bits higher. Pairs
# A (X_i bits 0-5) and B (6-11) of each word hold whole codes, G and H the last nibbles of X0
# and X1 with their top bits in X2: in f16 one LOP3 a pair for A and B, two for G and H, and
# five shifts a group (X0 >> 6, 10; X1 >> 6, 8; X2 >> 6), where a plane of high bits merged in
# costs two LOP3 every pair (docs/cost-model.md).
Q6_PAIRS: tuple[tuple[tuple[int, int, int, int], ...], ...] = (
    ((0, 0, 0, 6),),
    ((0, 6, 0, 6),),
    ((1, 0, 0, 6),),
    ((1, 6, 0, 6),),
    ((2, 0, 0, 6),),
    ((2, 6, 0, 6),),
    ((0, 12, 0, 4), (2, 12, 4, 2)),
    ((1, 12, 0, 4), (2, 14, 4, 2)),
)


def q6_pair_elems(k: int) -> tuple[int, int]:
    """The group's elements of pair k: the steps' pairs (e, e + 4), pairs 0-3 the first step's."""
    lo = 8 * (k // 4) + k % 4
    return lo, lo + 4


def _pack_q6(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`weight` words [..., K/8], `high` words [..., K/16]) of 6-bit codes q [..., K] (Q6_PAIRS)."""
    lead = q.shape[:-1]
    g = np.asarray(q, dtype=np.uint32).reshape(*lead, -1, 2, 16)
    words = np.zeros((*g.shape[:-1], 3), np.uint32)
    for k, parts in enumerate(Q6_PAIRS):
        for e, half in zip(q6_pair_elems(k), (0, 16), strict=True):
            for w, bit, off, n in parts:
                words[..., w] |= ((g[..., e] >> off) & ((1 << n) - 1)) << (bit + half)
    weight = words[..., :2].reshape(*lead, -1)
    return weight, np.ascontiguousarray(words[..., 2].reshape(*lead, -1))


def _unpack_q6(weight: np.ndarray, high: np.ndarray) -> np.ndarray:
    lead = weight.shape[:-1]
    x = np.asarray(weight, dtype=np.uint32).reshape(*lead, -1, 2, 2)
    words = np.concatenate([x, np.asarray(high, dtype=np.uint32).reshape(*lead, -1, 2, 1)], -1)
    q = np.zeros((*words.shape[:-1], 16), np.uint32)
    for k, parts in enumerate(Q6_PAIRS):
        for e, half in zip(q6_pair_elems(k), (0, 16), strict=True):
            for w, bit, off, n in parts:
                q[..., e] |= ((words[..., w] >> (bit + half)) & ((1 << n) - 1)) << off
    return q.reshape(*lead, -1).astype(np.uint8)


def _pack_bits(v: np.ndarray, pos: tuple[int, ...]) -> np.ndarray:
    """uint32 [..., n/len(pos)] of small values v (uint8 [..., n]), value i of each run of
    len(pos) at bit pos[i] of its word; no value crosses a byte of the word. Built a byte at a
    time in uint8 (a whole tensor repacks at load: a quarter of the memory traffic of uint32)."""
    v = np.asarray(v, dtype=np.uint8)
    lead, n = v.shape[:-1], len(pos)
    runs = v.reshape(*lead, -1, n)
    out = np.zeros((*runs.shape[:-1], 4), np.uint8)
    for i, p in enumerate(pos):
        out[..., p // 8] |= runs[..., i] << np.uint8(p % 8)
    return out.view("<u4")[..., 0]


def _unpack_bits(words: np.ndarray, pos: tuple[int, ...], bits: int) -> np.ndarray:
    lead = words.shape[:-1]
    v = (np.asarray(words)[..., None] >> np.asarray(pos, dtype=np.uint32)) & ((1 << bits) - 1)
    return v.reshape(*lead, -1).astype(np.uint8)


def _lo_positions(lo: int) -> tuple[int, ...]:
    return tuple(range(0, 32, 8)) if lo == 8 else code_word(lo).bit_of_element()


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1)


@register
@dataclass(frozen=True)
class Ggml(WeightFormat):
    kind: ClassVar[str] = "ggml"

    type: str

    allowed: ClassVar[ParamTable] = {
        "type": Allowed(
            tuple(SPECS),
            refusal="ggml: type {value!r} has no qir layout; expected {expected}",
        ),
    }

    @property
    def spec(self) -> Spec:
        return SPECS[self.type]

    def tag(self) -> str:
        return "ggml" + self.type.lower().replace("_", "")

    def input_multiple(self) -> tuple[int, str]:
        return self.spec.block, f"the {self.type} block"

    def describe(self) -> dict[str, Any]:
        return {"bits": self.spec.bits, "group": self.spec.run, "w4a4": False}

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        lay = row_layout(self.spec, in_features)
        return {
            "weight": TensorType((out_features, lay.codes // 4), U32),
            "fields": TensorType((out_features, lay.fields), U8),
        }

    def bytes_per_weight(self) -> float:
        """The planes' bytes (a row's padding to 16 bytes not counted)."""
        s = self.spec
        scales = 2 * (2 if s.mins else 1) / s.block
        return s.bits / 8 + scales + sub_bytes(s) / s.run

    @property
    def fragment(self) -> str:
        return "ggml"

    # ---- fields <-> planes -----------------------------------------------------------------

    def planes(self, f: Fields) -> dict[str, np.ndarray]:
        """Kernel-layout buffers of fields (any leading dims)."""
        s = self.spec
        lo, hi = lo_bits(s), hi_bits(s)
        lead, k = f.q.shape[:-1], f.q.shape[-1]
        lay = row_layout(s, k)

        def as_bytes(a: np.ndarray, dtype: str) -> np.ndarray:
            return np.ascontiguousarray(a.astype(dtype)).view(np.uint8).reshape(*lead, -1)

        if s.name == "Q6_K":
            codes, high = _pack_q6(f.q)
            parts = [as_bytes(high, "<u4")]
        else:
            codes = _pack_bits(f.q & ((1 << lo) - 1), _lo_positions(lo)).astype(np.uint32)
            parts = [as_bytes(_pack_high(f.q >> lo, lo, hi), "<u4")] if hi else []
        d = f.d.astype(np.float16)
        dm = as_bytes(_interleave(d, f.dmin) if f.dmin is not None else d, "<f2")
        if s.sub:
            assert f.sc is not None
            if s.sub == "sc" or f.mn is None:
                sub = f.sc.astype(np.int8).view(np.uint8)
            elif sub_bytes(s) == 1:
                sub = (f.sc | (f.mn << 4)).astype(np.uint8)
            else:
                sub = _interleave(f.sc.astype(np.uint8), f.mn.astype(np.uint8))
            parts.append(sub.reshape(*lead, -1))
        parts += [dm, np.zeros((*lead, lay.fields - lay.high - lay.scales), np.uint8)]
        return {
            "weight": np.ascontiguousarray(codes),
            "fields": np.ascontiguousarray(np.concatenate(parts, axis=-1)),
        }

    def fields(self, bufs: Mapping[str, np.ndarray], in_features: int) -> Fields:
        s = self.spec
        lo, hi = lo_bits(s), hi_bits(s)
        row = np.asarray(bufs["fields"])
        lay = row_layout(s, in_features)
        high = np.ascontiguousarray(row[..., : lay.high]).view("<u4")
        if s.name == "Q6_K":
            q = _unpack_q6(np.asarray(bufs["weight"]), high)
        else:
            q = _unpack_bits(np.asarray(bufs["weight"]), _lo_positions(lo), lo)
            if hi:
                q |= _unpack_high(high, lo, hi) << lo
        scales, sub = self.split_scales(row[..., lay.scales_at : lay.scales_at + lay.scales])
        d, dmin = (scales[..., 0::2], scales[..., 1::2]) if s.mins else (scales, None)
        sc = mn = None
        if s.sub:
            if s.sub == "sc":
                sc = sub.view(np.int8).astype(np.int16)
            elif sub_bytes(s) == 1:
                sc, mn = (sub & 15).astype(np.int16), (sub >> 4).astype(np.int16)
            else:
                sc, mn = sub[..., 0::2].astype(np.int16), sub[..., 1::2].astype(np.int16)
        return Fields(q, d, dmin, sc, mn)

    def split_scales(self, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The fp16 block scales (d, then dmin or m, interleaved) and the sub-block bytes (none
        without sub-blocks) of a row's scales plane (bytes)."""
        s = self.spec
        n = scales.shape[-1] * sub_bytes(s) * s.block // s.run // record_bytes(s) if s.sub else 0
        dm = np.ascontiguousarray(scales[..., n:]).view("<f2").astype(np.float16)
        return dm, scales[..., :n]

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None:
        super().check_buffers(bufs, out_features, in_features, where)
        lay = row_layout(self.spec, in_features)
        scales = np.asarray(bufs["fields"])[..., lay.scales_at : lay.scales_at + lay.scales]
        d = self.split_scales(scales)[0].astype(np.float32)
        if not np.all(np.isfinite(d)):
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(d))[0])
            block = at[-1] // (2 if self.spec.mins else 1)
            raise FormatError(
                f"{where}: {self.type} block {block} of row {at[-2]} has a NaN or Inf scale"
            )

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]:
        """Inputs start..stop (whole blocks): the rows rebuilt from their fields' slices (a
        copy: the planes of a row move when it gets shorter)."""
        s = self.spec
        if start % s.block or stop % s.block or not 0 <= start < stop <= in_features:
            raise FormatError(
                f"{where}: a K split {start}..{stop} of in_features {in_features} is not on "
                f"{s.name} block {s.block} boundaries, so it cannot be exact"
            )
        f = self.fields(bufs, in_features)

        def cut(a: np.ndarray | None, per: int) -> np.ndarray | None:
            return None if a is None else a[..., start // per : stop // per]

        q = f.q[..., start:stop]
        d = cut(f.d, s.block)
        assert d is not None
        return self.planes(Fields(q, d, cut(f.dmin, s.block), cut(f.sc, s.run), cut(f.mn, s.run)))

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        return decode(self.spec, self.fields(bufs, in_features))

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """Round-to-nearest from each block's extremes (ggml_blocks.encode): valid blocks of the
        type, not llama.cpp's error-searching quantizer."""
        return self.planes(encode(self.spec, self._quantize_input(w)))

    def repack(
        self, raw: np.ndarray, out_features: int, in_features: int, where: str
    ) -> dict[str, np.ndarray]:
        """Kernel-layout buffers of a tensor's raw blocks uint8 [..., out_features, row_bytes]
        (a 3-D expert tensor has the experts first)."""
        row = TYPES[_ID[self.type]].row_bytes(in_features)
        raw = np.asarray(raw)
        check_tensor(raw, where, (*raw.shape[:-2], out_features, row), np.uint8)
        bufs = self.planes(parse(self.spec, raw))
        lead = raw.shape[:-2]
        flat = {n: a.reshape(-1, *a.shape[len(lead) :]) for n, a in bufs.items()}
        for e in range(flat["weight"].shape[0]):
            self.check_buffers({n: a[e] for n, a in flat.items()}, out_features, in_features, where)
        return bufs


_ID = {t.name: i for i, t in TYPES.items()}


@dataclass(frozen=True)
class _LinearReader(GgmlReader):
    fmt: Ggml

    def format(self) -> WeightFormat:
        return self.fmt

    def repack(
        self, raw: np.ndarray, out_features: int, in_features: int, where: str
    ) -> dict[str, np.ndarray]:
        self.fmt.check_read_shape(out_features, in_features, where)
        return self.fmt.repack(raw, out_features, in_features, where)


class _Mxfp4Reader(GgmlReader):
    """ggml's MXFP4 as qir's: the same E2M1 codes and E8M0 byte (ggml's 2^(e-128) times doubled
    E2M1 values is E2M1 times 2^(e-127), both exact), the codes of a block reordered from ggml's
    halves (byte j: elements j and j + 16) to OCP's pairs (byte k: elements 2k and 2k + 1).
    Equal values, not bits, in one place: code 8 is E2M1's -0, which ggml's table reads as +0.
    Exponent 255 (ggml reads 2^127, OCP NaN) is refused, as for any MXFP4 weight."""

    def format(self) -> WeightFormat:
        return Mxfp4()

    def repack(
        self, raw: np.ndarray, out_features: int, in_features: int, where: str
    ) -> dict[str, np.ndarray]:
        fmt = Mxfp4()
        fmt.check_read_shape(out_features, in_features, where)
        row = TYPES[_ID["MXFP4"]].row_bytes(in_features)
        raw = np.asarray(raw)
        check_tensor(raw, where, (*raw.shape[:-2], out_features, row), np.uint8)
        b = raw.reshape(*raw.shape[:-1], -1, 17)
        codes = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], axis=-1)
        pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        bufs = {
            "weight": np.ascontiguousarray(pairs.reshape(*raw.shape[:-1], -1)),
            "scales": np.ascontiguousarray(b[..., 0]),
        }
        refuse_codes(bufs["scales"], (E8M0_NAN,), where, "E8M0 NaN (ggml reads 2^127)")
        return bufs


for _name in SPECS:
    register_ggml(_ID[_name])(partial(_LinearReader, Ggml(_name)))
register_ggml(_ID["MXFP4"])(_Mxfp4Reader)
