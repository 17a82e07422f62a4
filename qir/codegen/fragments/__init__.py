"""Per-format device dequant fragments: Python computes each fragment's constants and kernel
parameters from the format; the fragment template only substitutes them.

A rendered fragment is self-contained C++ (it includes `formats/fragment_head.cuh.j2` first and
`formats/fragment_tail.cuh.j2` last) and gives every kernel family the same interface over one
row of one weight, cut into chunks of `QIR_CHUNK` weights (one lane's unit of work):

  struct qir_weight { const T* __restrict__ <buffer>; ... };   the weight's buffers, in the
        order of the format's buffers() (`qir_weight{w_weight, w_scales, ...}`)
  qir_weight qir_row(const qir_weight& w, int row)
        the same buffers moved to row `row` (buffers shared by all rows stay): a kernel that
        walks one row computes this once and passes row 0 to qir_load
  struct qir_raw;                      the registers one (row, chunk) occupies once loaded
  (a) void qir_load(const qir_weight& w, int row, int chunk, qir_raw& r)
        issues the chunk's global loads (codes as raw words, the group's scale and zero) and
        nothing else, so a caller can keep several chunks' loads in flight before decoding any
  (b) template <typename T> void qir_decode(const qir_raw& r, uint32_t (&w)[QIR_CHUNK / 2])
        the chunk's weights as T pairs (T = __half or __nv_bfloat16; pair i = elements 2i and
        2i+1, the lower one in the low half) with scale and zero applied: what an MMA B fragment
        holds (one output row, consecutive k)
  void qir_decode_f32(const qir_raw& r, float (&w)[QIR_CHUNK])
        the same weights in float, rounded once as the numpy reference rounds them
  void qir_dequant_chunk(<buffers>, int row, int chunk, float (&w)[QIR_CHUNK])
        qir_load + qir_decode_f32: the entry point kernels used before the split

A packed fragment (context `packed`) also exposes the pieces (b) is built from, which a GEMV
uses to apply each group's scale (and MLX's bias) once to a partial sum instead of to every
weight:

  QIR_STEP, QIR_STRIDE      a step decodes QIR_STEP weights into QIR_STEP / 2 pairs, pair e of
                            each unit of 2 * QIR_STRIDE consecutive weights holding weights
                            (e, e + QIR_STRIDE) (the order bit tricks produce cheapest; the
                            activations are permuted the same way: qir_act_pairs)
  QIR_RUN_STEPS, QIR_RUNS   the chunk is QIR_RUNS runs of QIR_RUN_STEPS steps; one scale (and
                            zero, bias) per run
  template <typename T> void qir_step_codes(const qir_raw& r, int step, uint32_t (&c)[QIR_STEP / 2])
        exact codes as T pairs: c = (q - zero) * 2^-QIR_CODE_SHIFT for integer codes (MLX has
        no zero: its codes are centred, zero = QIR_CODE_OFFSET), value * 2^-QIR_CODE_SHIFT for
        E4M3/E2M1
  float qir_run_scale(const qir_raw& r, int run), float qir_run_bias(const qir_raw& r, int run)
        w = (c * 2^QIR_CODE_SHIFT + QIR_CODE_OFFSET) * qir_run_scale + qir_run_bias
        (QIR_CODE_OFFSET and the bias are MLX's, 0 elsewhere)
  QIR_ACT_SHIFT             the GEMV scales activations by 2^-QIR_ACT_SHIFT before the products
                            (E2M1, whose decode fixes its code scale)
  float qir_gemv_scale(const qir_raw& r, int run), float qir_gemv_finish(const qir_weight& w, float v)
        how a GEMV splits the scale: each run's sum times qir_gemv_scale, the row's total then
        through qir_gemv_finish (NVFP4's tensor scale, FP8's row or tensor scale: once per row
        instead of per run; the whole scale per run and identity elsewhere)

Both shifts are chosen (overflow_shift) so that QIR_RUN_STEPS * QIR_STEP products of codes with
any finite f16 activations, summed in f16 pairs, cannot overflow.

Non-packed fragments (dense weights, GPTQ act-order) define qir_decode_f32 themselves; qir_decode
is then built from it.

What several fragments share lives here: `make_fragment` (one `const T*` buffer per kernel
parameter), `byte_codes` (FP4/FP8 codes packed into bytes along the row) and
`bitstream_chunking` (integer codes in little-endian uint32 bitstreams)."""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qir.codegen.kernel import KernelParam
from qir.errors import Unsupported
from qir.formats.base import WeightFormat


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


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_load_all()
