"""Fragment constants for ggml's linear types (templates/formats/ggml.cuh.j2), over the planes of
qir.formats.ggml: low code bits (`weight`), high bits, block scales, sub-block scales.

A chunk is one 16-byte load of the row's codes (32 codes of 4 low bits, 64 of 2, 16 of 8) plus
its high bits, its block's d (and m or dmin) and its sub-blocks' scales, each one small load
from the row's `fields` (formats.ggml's planes); a run is a sub-block (at most 32 codes), whose
scale d * sc (and min) the GEMV applies once to the run's sum. A step is 8 codes, 4 pairs, at
every width.

Packed decode, per step (see int_codes.py for the magic-number trick; formats.ggml.code_word
for where the pairs sit): pair e holds codes (e, e + 4) in the two halves of a word; the low
fields are masked in place where they fit T's unit-1 window together with their high bits and
the zero, after one shift of the word per step in f16 (per pair where bf16's narrower window
needs it), and the high bits are ORed in right above them from one rotation of their word
(formats.ggml.high_tiling places them so that, in f16, one rotation serves a step, and a word's
first step needs none). Q8_0's bytes take f16's magic exponent byte by PRMT; IQ4's 16 table
values take two PRMT lookups (magnitudes of the negative and of the positive entries, a code's
sign bit selecting zero in the other) and one subtraction into offset-binary bytes, then the
same.
Types with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) keep their codes centred, as MLX's are
(int_codes.py): half the code range, a bias term that does not cancel most of the codes' sum.
"""

from __future__ import annotations

from typing import Any

from qir.codegen.fragments.base import (
    MAX_RUN_PAIRS,
    Fragment,
    FragmentBuffer,
    make_fragment,
    overflow_shift,
    register_fragment,
)
from qir.formats.ggml import (
    Q6_PAIRS,
    CodeWord,
    Ggml,
    code_word,
    hi_bits,
    high_tiling,
    lo_bits,
    row_layout,
    sub_bytes,
)
from qir.formats.ggml_blocks import Spec
from qir.types import WeightFormat


def _shifts(cw: CodeWord, bits: int, zero: int, window: int) -> list[int]:
    """The word shift of each pair for T: the step's common shift where the field, holding the
    code and the zero, fits T's window there (the mantissa bits below the magic exponent: 10
    for f16, 7 for bf16), else the field's own bit (position 0)."""
    top = window - max(bits, max(zero, 1).bit_length())
    return [sh if f - sh <= top else f for f, sh in zip(cw.field, cw.shift, strict=True)]


def _table_luts(table: tuple[int, ...]) -> dict[str, str]:
    """PRMT tables of IQ4's magnitudes: codes 0-7 are the negative entries, 8-15 the positive."""

    def word(vals: list[int]) -> str:
        return f"0x{sum(v << (8 * i) for i, v in enumerate(vals)):08X}u"

    neg, pos = [-v for v in table[:8]], list(table[8:])
    assert all(0 <= v < 128 for v in neg + pos), table
    return {
        "neg_lo": word(neg[:4]),
        "neg_hi": word(neg[4:]),
        "pos_lo": word(pos[:4]),
        "pos_hi": word(pos[4:]),
    }


def _high(spec: Spec, cw: CodeWord, chunk: int) -> dict[str, Any]:
    """The high bits' word (chunk-local) per step and their bit per step and pair."""
    lo, hi = lo_bits(spec), hi_bits(spec)
    if not hi:
        return {"high_words": 0}
    per_word, pos = high_tiling(lo, hi)
    assert chunk % per_word == 0, (spec.name, chunk, per_word)
    spw = cw.elems // 8
    elems = [
        [s // spw * cw.elems + cw.lo[s % spw * 4 + e] for e in range(4)] for s in range(chunk // 8)
    ]
    return {
        "high_words": chunk * hi // 32,
        "high_word": [row[0] // per_word for row in elems],
        "high_bit": [[pos[j % per_word] for j in row] for row in elems],
    }


# Q6_K's pairs' bit in T (f16's window of 10 bits, bf16's 7): where the f16 shifts of a group's
# words are shared (G's and H's X2 >> 6 with B's; formats.ggml.Q6_PAIRS); bf16 takes each at 0.
_Q6_POS = {10: (0, 0, 0, 0, 0, 0, 2, 4), 7: (0,) * 8}


def _q6(zero: int, chunk: int) -> dict[str, Any]:
    """Q6_K's parts per pair (formats.ggml.Q6_PAIRS): word, bits, and per T shift and bit."""
    parts = [list(p) + [p[0]] * (2 - len(p)) for p in Q6_PAIRS]
    shift, at = [], []
    for win, pos in _Q6_POS.items():
        assert all(q + max(6, zero.bit_length()) <= win for q in pos), (win, pos)
        at.append([[pos[k] + off for _, _, off, _ in ps] for k, ps in enumerate(parts)])
        shift.append([[bit - pos[k] - off for _, bit, off, _ in ps] for k, ps in enumerate(parts)])
        assert all(x >= 0 for row in shift[-1] for x in row), shift
    return {
        "q6": True,
        "high_words": chunk * 2 // 32,
        "q6_parts": [len(p) for p in Q6_PAIRS],
        "q6_word": [[w for w, *_ in ps] for ps in parts],
        "q6_bits": [
            [n if i < len(Q6_PAIRS[k]) else 0 for i, (*_, n) in enumerate(ps)]
            for k, ps in enumerate(parts)
        ],
        "q6_shift": shift,
        "q6_at": at,
        "q6_pos": [list(p) for p in _Q6_POS.values()],
    }


@register_fragment("ggml")
def _ggml(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    assert isinstance(fmt, Ggml)
    s = fmt.spec
    lo, hi = lo_bits(s), hi_bits(s)
    chunk = {4: 32, 2: 64, 8: 16}[lo]
    step = 8
    stride = 2 if s.table else 1 if lo == 8 else 4
    run = min(s.run, chunk, 2 * MAX_RUN_PAIRS)
    centred = bool(s.mins)
    zero = 1 << (s.bits - 1) if centred else s.zero
    code_max = 127 if s.table else max(zero, (1 << s.bits) - 1 - zero)
    per_block = 2 if s.mins else 1
    lay = row_layout(s, in_features)
    buffers: dict[str, FragmentBuffer] = {
        "weight": ("uint32_t", lay.codes // 4),
        "fields": ("uint8_t", lay.fields),
    }
    context: dict[str, Any] = {
        "what": f"ggml {s.name}",
        "packed": True,
        "lo_bits": lo,
        "hi_bits": hi,
        "chunk_words": chunk * lo // 32,
        "step": step,
        "stride": stride,
        "run_steps": run // step,
        "runs": chunk // run,
        "run_elems": run,
        "zero": zero,
        "code_offset": zero if centred else 0,
        "code_shift": overflow_shift(run // 2, code_max),
        "block": s.block,
        "per_block": per_block,
        "mins": s.mins,
        "sub": s.sub,
        "sub_nibbles": s.sub == "sc_mn" and sub_bytes(s) == 1,
        "sub_chunk_bytes": chunk // s.run * sub_bytes(s) if s.sub else 0,
        "sub_per_run": sub_bytes(s),
        "sub_bytes_row": in_features // s.run * sub_bytes(s),
        "scales_at": lay.scales_at,
        "chunks_per_block": s.block // chunk,
        # a lane's pair of chunks (qgemv's qir_chunks: c even, c + 1) in one block
        "load_pair": s.block // chunk % 2 == 0,
        # a 16-bit d and a chunk's sub-block bytes, at most 2, in one register
        "sub_in_d": bool(s.sub) and per_block == 1 and chunk // s.run * sub_bytes(s) <= 2,
        "table": bool(s.table),
        "high_words": 0,
        # Q6_K's chunk holds the most registers (4 code words, 2 high words, d and sub-scales):
        # its part of a Q4_K_M q/k/v launch spilled 12 B on sm_120a, its gate/up experts at two
        # rows of both 236-292 B on sm_80 and sm_90 (the dense gate/up pair does not spill:
        # 151-168 registers on sm_80 to sm_120a, with its rms_norm prologue too)
        **({"crowded_slots": 2} if s.name == "Q6_K" else {}),
        **(_table_luts(s.table) if s.table else {}),
    }
    if lo < 8 and not s.table:
        cw = code_word(lo)
        spw = cw.elems // 8
        context |= {
            "steps_per_word": spw,
            "field": [list(cw.field[i * 4 : i * 4 + 4]) for i in range(spw)],
            "shifts": [
                [sh[i * 4 : i * 4 + 4] for i in range(spw)]
                for sh in (_shifts(cw, s.bits, zero, w) for w in (10, 7))
            ],
            **(_q6(zero, chunk) if s.name == "Q6_K" else _high(s, cw, chunk)),
        }
    return make_fragment("formats/ggml.cuh.j2", buffers, chunk, context)
