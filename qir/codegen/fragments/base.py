"""The fragment interface and what several fragments share (see the package's docstring); below
every fragment module, so that each registers itself without importing the package that loads
them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qir.codegen.kernel import KernelParam
from qir.errors import Unsupported
from qir.types import WeightFormat


@dataclass(frozen=True)
class Fragment:
    template: str
    params: tuple[KernelParam, ...]  # in the order of the format's buffers()
    buffers: tuple[str, ...]
    chunk_elems: int
    context: dict[str, Any]

    def chunks_per_row(self, in_features: int) -> int:
        return in_features // self.chunk_elems

    @property
    def packed(self) -> bool:
        return bool(self.context["packed"])

    @property
    def e2m1(self) -> bool:
        """Whether it decodes E2M1 codes (MXFP4, NVFP4): the decode a target's FP4 conversion
        changes (qir_common.cuh's QIR_FP4_CVT)."""
        return self.template == "formats/float_codes.cuh.j2" and self.context["elem_bits"] == 4

    def weight_init(self, prefix: str) -> str:
        """`qir_weight{...}` from the kernel parameters named `<prefix><buffer>`."""
        return "qir_weight{" + ", ".join(f"{prefix}{b}" for b in self.buffers) + "}"


# Per-lane register budget: a chunk is at most this many weights.
MAX_CHUNK_ELEMS = 64
# Products a run may add in one half of a pair before it is widened to float: longer runs cost
# fewer conversions, and need codes scaled further down to stay clear of overflow (see
# int_codes.py).
MAX_RUN_PAIRS = 16

MakeFragment = Callable[[WeightFormat, int, int], Fragment]
FRAGMENTS: dict[str, MakeFragment] = {}


def register_fragment(name: str) -> Callable[[MakeFragment], MakeFragment]:
    """Registers the function that builds a format's fragment; one module per fragment."""

    def deco(fn: MakeFragment) -> MakeFragment:
        FRAGMENTS[name] = fn
        return fn

    return deco


# A buffer of a fragment: (C element type, elements per row; 0 for a buffer all rows share),
# optionally with a third entry, the rows that share one such stride (block-wise scales).
FragmentBuffer = tuple[str, int] | tuple[str, int, int]


def _moved(name: str, buffer: FragmentBuffer) -> str:
    stride, per = buffer[1], (buffer[2] if len(buffer) == 3 else 1)
    if not stride:
        return f"w.{name}"
    return f"w.{name} + (size_t){'row' if per == 1 else f'(row / {per})'} * {stride}"


def make_fragment(
    template: str,
    buffers: Mapping[str, FragmentBuffer],
    chunk_elems: int,
    context: dict[str, Any],
) -> Fragment:
    """A fragment whose kernel parameters are `const T* __restrict__ w_<buffer>`, one per entry
    of `buffers` (buffer name -> FragmentBuffer), in the order of the format's buffers().
    `context` must say whether the fragment is `packed`; the head and tail includes get the
    weight struct and the compat entry point's signature from here."""
    params = tuple(
        KernelParam(f"w_{name}", f"const {b[0]}* __restrict__", "buffer")
        for name, b in buffers.items()
    )
    moved = (_moved(n, b) for n, b in buffers.items())
    head = {
        "split_scale": False,
        "chunk_elems": chunk_elems,
        "weight_fields": [f"const {b[0]}* __restrict__ {n};" for n, b in buffers.items()],
        "weight_row": "qir_weight{" + ", ".join(moved) + "}",
        "weight_params": ", ".join(f"{p.c_type} {p.name}" for p in params),
        "weight_args": ", ".join(p.name for p in params),
    }
    return Fragment(template, params, tuple(buffers), chunk_elems, {**head, **context})


def byte_codes(
    template: str,
    elem_bits: int,
    in_features: int,
    chunk_elems: int,
    scales: Mapping[str, FragmentBuffer],
    **context: Any,
) -> Fragment:
    """A fragment of `elem_bits`-wide float codes (4 or 8) packed into the bytes of each row,
    buffer `weight`, then the scale buffers `scales` (as make_fragment's buffers); the context
    gets the chunk's and the row's sizes on top of `context`."""
    chunk_bytes = chunk_elems * elem_bits // 8
    sizes = {
        "elem_bits": elem_bits,
        "chunk_bytes": chunk_bytes,
        "chunk_words": chunk_bytes // 4,
        "bytes_per_row": in_features * elem_bits // 8,
    }
    buffers: dict[str, FragmentBuffer] = {"weight": ("uint8_t", sizes["bytes_per_row"]), **scales}
    return make_fragment(template, buffers, chunk_elems, {**sizes, **context})


def bitstream_chunking(
    bits: int, in_features: int, max_elems: int = MAX_CHUNK_ELEMS
) -> dict[str, int]:
    """Chunk constants of a row of `bits`-wide integer codes in a little-endian uint32 bitstream
    (qir.formats.bitstream)."""
    words_per_row = in_features * bits // 32
    if 32 % bits == 0:
        # Codes never straddle words: the widest load (up to 128 bits) dividing the row whose
        # chunk is a whole number of 8-weight activation loads.
        chunk_words = next(
            c
            for c in (4, 2, 1)
            if words_per_row % c == 0 and c * 32 // bits <= max_elems and c * 32 // bits % 8 == 0
        )
        vec_words = chunk_words
    else:
        # 3/5/6-bit: 32 codes fill exactly `bits` words; rows are only 4-byte aligned.
        chunk_words, vec_words = bits, 1
    return {
        "bits": bits,
        "mask": (1 << bits) - 1,
        "words_per_row": words_per_row,
        "chunk_words": chunk_words,
        "vec_words": vec_words,
        "chunk_elems": chunk_words * 32 // bits,
    }


def overflow_shift(run_pairs: int, code_max: float) -> int:
    """The smallest s with 2^s >= 4 * run_pairs * code_max: codes scaled by 2^-s keep a run's
    sum in a 16-bit pair below half of f16's largest value, whatever the f16 activations (the
    GEMV adds 2 * run_pairs products, then the pair's halves; see int_codes.py)."""
    return max(0, math.ceil(math.log2(4 * run_pairs * code_max)))


def fragment_for(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    try:
        make = FRAGMENTS[fmt.fragment]
    except KeyError:
        raise Unsupported(f"no device dequant fragment for {fmt.spell()} yet") from None
    return make(fmt, out_features, in_features)
