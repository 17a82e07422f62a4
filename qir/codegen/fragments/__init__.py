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

Two optional pieces (ggml's, `fragments/ggml.py`), each announced in the context:

  void qir_load_pair(const qir_weight& w, int row, int c, qir_raw& a, qir_raw& b)   (`load_pair`)
        chunks c and c + 1 (c even) of one block: their fields of the whole block (a K-quant's
        d and dmin) loaded once, for a GEMV lane's pair of chunks
  void qir_step_bytes(const qir_raw& r, int step, uint32_t (&b)[2])                 (`table`)
        a step's values as bytes 128 + value, k order (stride 2): the GEMV's int path at M = 1
        multiplies them with integer activations by DP4A (qgemv.cu.j2, gemv.int_act_fits)

Both shifts are chosen (overflow_shift) so that QIR_RUN_STEPS * QIR_STEP products of codes with
any finite f16 activations, summed in f16 pairs, cannot overflow.

Non-packed fragments (dense weights, GPTQ act-order) define qir_decode_f32 themselves; qir_decode
is then built from it.

What several fragments share lives in `base`, below every fragment module and with the registry:
`make_fragment` (one `const T*` buffer per kernel parameter), `byte_codes` (FP4/FP8 codes packed
into bytes along the row) and `bitstream_chunking` (integer codes in little-endian uint32
bitstreams)."""

from __future__ import annotations

import importlib
import pkgutil

from qir.codegen.fragments.base import (
    FRAGMENTS,
    MAX_CHUNK_ELEMS,
    MAX_RUN_PAIRS,
    Fragment,
    FragmentBuffer,
    MakeFragment,
    bitstream_chunking,
    byte_codes,
    fragment_for,
    make_fragment,
    overflow_shift,
    register_fragment,
)

__all__ = [
    "FRAGMENTS",
    "MAX_CHUNK_ELEMS",
    "MAX_RUN_PAIRS",
    "Fragment",
    "FragmentBuffer",
    "MakeFragment",
    "bitstream_chunking",
    "byte_codes",
    "fragment_for",
    "make_fragment",
    "overflow_shift",
    "register_fragment",
]


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_load_all()
