"""AutoAWQ int4 (HF `quant_method: "awq"`), asymmetric with a zero point per group.

Kernel layout (output-major, packed along the input dim) is AutoAWQ's own GEMV layout:

  weight [O, I/8]      uint32   element i of row o at bits 4*(i%8) of word i//8
  zeros  [O, Zw]       uint32   group j of row o at bits 4*(j%8) of word j//8
  scales [O, 8*Zw]     float16  group j of row o in column j

`Zw = zeros_width(I, g)` pads the groups to whole words and then to AutoAWQ's
`calculate_zeros_width` multiple; padding columns are zero and never read. Decode is
`(q - z) * s` with unsigned zeros 0..15 (no +1 offset, unlike GPTQ v1).

A GEMV checkpoint is already in this layout, so it is read as stored (zero-copy views): keeping
its padded widths costs 2.5 bytes per padding group per row and saves a copy of every tensor at
load. A GEMM checkpoint (`qweight [I, O/8]`, packed along the *output* dim in the interleaved
nibble order [0,2,4,6,1,3,5,7]) is repacked once by `repack_gemm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from qir.dtypes import F16, U32
from qir.errors import FormatError
from qir.formats.base import Allowed, ParamTable, WeightFormat, check_tensor
from qir.formats.bitstream import pack_codes, unpack_codes
from qir.formats.registry import register
from qir.types import TensorType

GROUP_SIZES = (32, 64, 128)
# Nibble slot k of a GEMM word holds logical column 8*w + GEMM_ORDER[k] (AutoAWQ's AWQ_ORDER).
GEMM_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_MAXQ = 15


def zeros_width(in_features: int, group_size: int) -> int:
    """Words per row of GEMV `qzeros` (AutoAWQ's calculate_zeros_width)."""
    multiple = {32: 4, 64: 2}.get(group_size, 1)
    words = -(-(in_features // group_size) // 8)
    return -(-words // multiple) * multiple


@register
@dataclass(frozen=True)
class Awq(WeightFormat):
    kind: ClassVar[str] = "awq"

    bits: int
    group_size: int

    allowed: ClassVar[ParamTable] = {
        "bits": Allowed((4,), expected="4 (AutoAWQ writes 4-bit only)"),
        "group_size": GROUP_SIZES,
    }

    def tag(self) -> str:
        return f"awq{self.bits}g{self.group_size}"

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]:
        """A K shard: the codes as a view; zeros and scales copied into the part's own padded
        widths (eight groups' zeros share a word, so a cut between groups moves nibbles)."""
        g = self.group_size
        if start % g or stop % g or not 0 <= start < stop <= in_features:
            raise FormatError(
                f"{where}: a K split {start}..{stop} of in_features {in_features} is not on "
                f"group boundaries (group size {g}), so it cannot be exact"
            )
        g0, g1 = start // g, stop // g
        zw = zeros_width(stop - start, g)
        zeros = unpack_codes(np.asarray(bufs["zeros"]), 4, self.groups(in_features))[:, g0:g1]
        padded = np.zeros((out_features, 8 * zw), np.uint32)
        padded[:, : g1 - g0] = zeros
        scales = np.zeros((out_features, 8 * zw), np.float16)
        scales[:, : g1 - g0] = np.asarray(bufs["scales"])[:, g0:g1]
        return {
            "weight": bufs["weight"][:, start // 8 : stop // 8],
            "zeros": pack_codes(padded, 4),
            "scales": scales,
        }

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        zw = zeros_width(in_features, self.group_size)
        return {
            "weight": TensorType((out_features, in_features // 8), U32),
            "zeros": TensorType((out_features, zw), U32),
            "scales": TensorType((out_features, 8 * zw), F16),
        }

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        n = self.groups(in_features)
        q = unpack_codes(np.asarray(bufs["weight"]), 4, in_features).astype(np.float32)
        z = unpack_codes(np.asarray(bufs["zeros"]), 4, n).astype(np.float32)[..., None]
        s = np.asarray(bufs["scales"])[:, :n].astype(np.float32)[..., None]
        w = (q.reshape(out_features, n, self.group_size) - z) * s
        return w.reshape(out_features, in_features)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """AutoAWQ's pseudo_quantize_tensor (zero_point=True) plus its packing, in float32.

        AutoAWQ packs with the fp16 scales it stores (`round((w + z*s) / s_fp16)`), so here the
        zero and the codes are derived from the stored fp16 scale too."""
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        g = w.reshape(out_features, -1, self.group_size)
        w_max, w_min = g.max(axis=-1, keepdims=True), g.min(axis=-1, keepdims=True)
        s = (np.maximum(w_max - w_min, np.float32(1e-5)) / np.float32(_MAXQ)).astype(np.float16)
        s32 = s.astype(np.float32)
        z = np.clip(-np.rint(w_min / s32), 0, _MAXQ)
        q = np.clip(np.rint(g / s32) + z, 0, _MAXQ).astype(np.uint32)
        return layout(q.reshape(out_features, in_features), z[..., 0], s[..., 0], self.group_size)

    def bytes_per_weight(self) -> float:
        # Codes, plus one fp16 scale and one 4-bit zero per group (padding is never read).
        return self.bits / 8 + (2 + 0.5) / self.group_size

    @property
    def fragment(self) -> str:
        return "awq"


def layout(q: np.ndarray, z: np.ndarray, s: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """Kernel buffers from codes q [O, I], zeros z [O, I/g] and fp16 scales s [O, I/g]."""
    out_features, in_features = q.shape
    zw = zeros_width(in_features, group_size)
    zeros = np.zeros((out_features, 8 * zw), np.uint32)
    zeros[:, : z.shape[1]] = z
    scales = np.zeros((out_features, 8 * zw), np.float16)
    scales[:, : s.shape[1]] = s
    return {
        "weight": pack_codes(q.astype(np.uint32), 4),
        "zeros": pack_codes(zeros, 4),
        "scales": scales,
    }


def _read_shape(
    qweight: np.ndarray, group_size: int, where: str, gemm: bool
) -> tuple[Awq, int, int]:
    """The format and (out_features, in_features) of a checkpoint's `qweight`: GEMM [I, O/8]
    or GEMV [O, I/8]."""
    fmt = Awq(4, group_size)
    if qweight.ndim != 2:
        dims = "in, out/8" if gemm else "out, in/8"
        raise FormatError(f"{where}.qweight: {qweight.ndim}-D, expected int32 [{dims}]")
    rows, cols = qweight.shape
    out_features, in_features = (cols * 8, rows) if gemm else (rows, cols * 8)
    fmt.check_read_shape(out_features, in_features, f"{where}.qweight")
    return fmt, out_features, in_features


def _int32(a: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    check_tensor(a, name, shape, np.int32)
    return a.view(np.uint32)


def unpack_gemm(words: np.ndarray) -> np.ndarray:
    """Codes [R, 8*C] from GEMM-packed int32/uint32 [R, C] (interleaved nibble order)."""
    words = np.asarray(words).view(np.uint32)
    shifts = np.uint32(4) * np.argsort(GEMM_ORDER).astype(np.uint32)
    codes = (words[..., None] >> shifts) & np.uint32(0xF)
    result: np.ndarray = codes.reshape(words.shape[0], -1)
    return result


def repack_gemm(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int, where: str
) -> tuple[Awq, int, int, dict[str, np.ndarray]]:
    """A GEMM checkpoint's `qweight [I, O/8]`, `qzeros [I/g, O/8]`, `scales [I/g, O]` into the
    kernel layout; returns (format, out_features, in_features, buffers)."""
    fmt, out_features, in_features = _read_shape(qweight, group_size, where, gemm=True)
    n = in_features // group_size
    qw = _int32(qweight, f"{where}.qweight", (in_features, out_features // 8))
    qz = _int32(qzeros, f"{where}.qzeros", (n, out_features // 8))
    check_tensor(scales, f"{where}.scales", (n, out_features), np.float16)
    bufs = layout(unpack_gemm(qw).T, unpack_gemm(qz).T, scales.T, group_size)
    return fmt, out_features, in_features, bufs


def read_gemv(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int, where: str
) -> tuple[Awq, int, int, dict[str, np.ndarray]]:
    """A GEMV checkpoint (`qweight [O, I/8]`, `qzeros [O, Zw]`, `scales [O, 8*Zw]`) is the kernel
    layout already: its tensors are checked and returned as uint32/fp16 views, not copied."""
    fmt, out_features, in_features = _read_shape(qweight, group_size, where, gemm=False)
    zw = zeros_width(in_features, group_size)
    bufs = {
        "weight": _int32(qweight, f"{where}.qweight", (out_features, in_features // 8)),
        "zeros": _int32(qzeros, f"{where}.qzeros", (out_features, zw)),
    }
    check_tensor(scales, f"{where}.scales", (out_features, 8 * zw), np.float16)
    bufs["scales"] = scales
    return fmt, out_features, in_features, bufs
