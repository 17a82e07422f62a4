"""GPTQ (AutoGPTQ / GPTQModel; HF `quant_method: "gptq"`), 2/3/4/8-bit, optional act-order.

Checkpoint: `qweight [I*bits/32, O]` int32 packed along the input dim, `qzeros [G, O*bits/32]`
packed along the output dim, `scales [G, O]`, `g_idx [I]` (G = ceil(I/g)). For every width the
within-column packing is a little-endian bitstream: element i at stream bits [i*bits,
(i+1)*bits) (3-bit codes straddle words exactly like MLX's), so `qweight.T` *is* the
output-major kernel weight.

Kernel layout:

  weight [O, I*bits/32]  uint32       row o = the bitstream of W[o, :]'s codes
  zeros  [O, G]          uint8        the stored zero field, as written (see zero_offset)
  scales [O, G]          scale_dtype
  g_idx  [I]             int32        only with act_order=1: the group of each input channel

G = ceil(I/g), except in a K part of an act-order weight (a tensor-parallel shard), which keeps
the whole's G (`groups`): its inputs may sit in any of the whole's groups.

Decode: `(q - (zeros[g] + zero_offset)) * scales[g]` with g = g_idx[i] (or i // group_size).
v1 (`checkpoint_format: "gptq"`) stores zero - 1 and every v1 decoder adds 1 back to the masked
field (so a stored all-ones field means 2^bits); v2 (`"gptq_v2"`) stores the zero itself. Keeping
the stored field and adding the offset in the kernel reproduces both without a wider zeros type.

With act-order the input channels' groups are an arbitrary map; the kernel gathers each weight's
zero and scale through `g_idx` (permuting input channels would need x permuted too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

import qir.types as ir
from qir.dtypes import BF16, F16, F32, I32, U8, U32, DType
from qir.errors import FormatError
from qir.formats.base import (
    Allowed,
    ParamTable,
    WeightFormat,
    check_tensor,
    dtype_among,
)
from qir.formats.bitstream import pack_codes, unpack_codes
from qir.formats.registry import register
from qir.types import TensorType

BITS = (2, 3, 4, 8)
SCALE_DTYPES = (F16, BF16, F32)
# checkpoint_format -> what decoders add to the stored zero field.
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


@register
@dataclass(frozen=True)
class Gptq(WeightFormat):
    kind: ClassVar[str] = "gptq"

    bits: int
    group_size: int  # the family resolves HF's -1 (one group per row) to in_features
    checkpoint_format: str
    act_order: int  # 1: a g_idx buffer maps input channels to groups
    scale_dtype: DType
    groups: int = 0  # act-order: the zeros/scales columns where not ceil(in/g) (a K part's)

    allowed: ClassVar[ParamTable] = {
        "bits": BITS,
        "group_size": Allowed(test=lambda g: g >= 1, expected=">= 1"),
        "checkpoint_format": Allowed(
            tuple(ZERO_OFFSET),
            refusal="not supported: GPTQ checkpoint_format {value} (expected {expected})",
        ),
        "act_order": (0, 1),
        "scale_dtype": SCALE_DTYPES,
        "groups": Allowed(test=lambda n: n >= 0, expected=">= 0"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.groups and not self.act_order:
            raise FormatError(f"gptq: groups={self.groups} needs act_order=1 (a g_idx)")

    def params(self) -> dict[str, Any]:
        p = super().params()
        if not self.groups:
            del p["groups"]  # the usual ceil(in/g) goes unspelled
        return p

    @property
    def zero_offset(self) -> int:
        return ZERO_OFFSET[self.checkpoint_format]

    def tag(self) -> str:
        v = "v2" if self.zero_offset == 0 else ""
        act = f"act{self.groups or ''}" if self.act_order else ""
        return f"gptq{v}{self.bits}g{self.group_size}{act}{self.scale_dtype.name}"

    def group_count(self, in_features: int) -> int:
        """The zeros/scales columns of a weight of in_features."""
        return self.groups or -(-in_features // self.group_size)

    def holding(self, groups: int, in_features: int) -> Gptq:
        """This act-order format with `groups` columns for a weight of in_features (spelled
        only where that is not ceil(in/g))."""
        return replace(self, groups=0 if groups == -(-in_features // self.group_size) else groups)

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        n = self.group_count(in_features)
        bufs = {
            "weight": TensorType((out_features, in_features * self.bits // 32), U32),
            "zeros": TensorType((out_features, n), U8),
            "scales": TensorType((out_features, n), self.scale_dtype),
        }
        if self.act_order:
            bufs["g_idx"] = TensorType((in_features,), I32)
        return bufs

    def input_multiple(self) -> tuple[int, str]:
        # Whole words per row (groups need not divide in_features: the last one may be short).
        return self._words(), ""

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None:
        super().check_buffers(bufs, out_features, in_features, where)
        if np.any(np.asarray(bufs["zeros"]) >> self.bits):
            raise FormatError(f"{where}.zeros: values above {(1 << self.bits) - 1}")
        if self.act_order:
            g_idx = np.asarray(bufs["g_idx"])
            n = self.group_count(in_features)
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= n):
                raise FormatError(
                    f"{where}.g_idx: values in [{g_idx.min()}, {g_idx.max()}], expected [0, {n})"
                )

    def _words(self) -> int:
        """Inputs per packed word (the kernel dequantizes at least 8 at a time)."""
        return max(8, 32 // int(np.gcd(32, self.bits)))

    def column_unit(self, in_features: int) -> int:
        """Whole words, and whole groups where a K part takes the groups it covers (with
        act-order a part keeps every group, and one group per row is every part's)."""
        if self.act_order or self.group_size >= in_features:
            return self._words()
        return int(np.lcm(self.group_size, self._words()))

    def column_part(self, in_features: int, start: int, stop: int) -> WeightFormat:
        if self.act_order:
            return self.holding(self.group_count(in_features), stop - start)
        return self

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]:
        """A K shard, `self` the part's format (column_part). Without act-order: views of the
        codes and of the groups start..stop covers (the cut on group boundaries). With
        act-order the part's inputs may sit in any of the whole's groups, so it keeps all of
        them, g_idx as it is: the columns of the groups its inputs use, zeros elsewhere
        (what a rank reading its own part gets, qir.models.quant_conventions.gptq)."""
        g, unit = self.group_size, self.column_unit(in_features)
        if start % unit or (stop % unit and stop != in_features) or not 0 <= start < stop:
            what = (
                f"{unit}-input words"
                if unit == self._words()
                else f"group boundaries (group size {g})"
            )
            raise FormatError(
                f"{where}: a K split {start}..{stop} of in_features {in_features} is not on "
                f"{what}, so it cannot be exact"
            )
        weight = bufs["weight"][:, start * self.bits // 32 : stop * self.bits // 32]
        if not self.act_order:
            g0, n = start // g, self.group_count(stop - start)
            return {
                "weight": weight,
                "zeros": bufs["zeros"][:, g0 : g0 + n],
                "scales": bufs["scales"][:, g0 : g0 + n],
            }
        g_idx = np.asarray(bufs["g_idx"])[start:stop]
        used = np.unique(g_idx)
        out = {"weight": weight, "g_idx": g_idx}
        for name in ("zeros", "scales"):
            whole = np.asarray(bufs[name])
            part = np.zeros_like(whole)
            part[:, used] = whole[:, used]
            out[name] = part
        return out

    def recast(
        self, fmt: ir.WeightFormat, bufs: Mapping[str, np.ndarray], in_features: int
    ) -> dict[str, np.ndarray] | None:
        """A part of an act-order weight whose inputs keep their groups in order reads as a
        plain one: as act-order, its g_idx is the trivial map. A part of a weight of one group
        per row reads with a group of its own width (HF's group_size -1): the same one group."""
        if self.act_order and not self.groups and fmt == replace(self, act_order=0):
            trivial = (np.arange(in_features) // self.group_size).astype(np.int32)
            return {**bufs, "g_idx": trivial}
        if self.group_size >= in_features and fmt == replace(self, group_size=in_features):
            return dict(bufs)
        return super().recast(fmt, bufs, in_features)

    def group_of(self, bufs: Mapping[str, np.ndarray], in_features: int) -> np.ndarray:
        if self.act_order:
            return np.asarray(bufs["g_idx"]).astype(np.intp)
        return np.arange(in_features) // self.group_size

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        q = unpack_codes(np.asarray(bufs["weight"]), self.bits, in_features).astype(np.float32)
        gi = self.group_of(bufs, in_features)
        z = np.asarray(bufs["zeros"]).astype(np.float32)[:, gi] + np.float32(self.zero_offset)
        s = np.asarray(bufs["scales"]).astype(np.float32)[:, gi]
        return (q - z) * s

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """Round-to-nearest with GPTQ's asymmetric Quantizer (no Hessian error feedback); with
        act_order=1 the g_idx buffer is the trivial i // group_size."""
        return self.quantize_grouped(w)

    def quantize_grouped(
        self, w: np.ndarray, g_idx: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Like quantize, with input channel i in group g_idx[i] (needs act_order=1 unless g_idx
        is the trivial map, which None stands for)."""
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        n = self.group_count(in_features)
        trivial = np.arange(in_features) // self.group_size
        g_idx = np.asarray(trivial if g_idx is None else g_idx, dtype=np.int32)
        if not self.act_order and not np.array_equal(g_idx, trivial):
            raise FormatError(f"{self.spell()}: a non-trivial g_idx needs act_order=1")
        maxq = np.float32((1 << self.bits) - 1)
        # GPTQ's Quantizer.find_params: the range always includes 0, an all-zero group is [-1, 1].
        lo = np.zeros((out_features, n), np.float32)
        hi = np.zeros((out_features, n), np.float32)
        at = (np.arange(out_features)[:, None], g_idx[None, :])
        np.minimum.at(lo, at, w)
        np.maximum.at(hi, at, w)
        empty = (lo == 0) & (hi == 0)
        lo, hi = np.where(empty, np.float32(-1), lo), np.where(empty, np.float32(1), hi)
        # v1 stores zero - 1, so a zero of 0 cannot be written: those groups spread [0, hi] over
        # one level less and take zero 1 (lo > -scale/2 still lands on a code).
        zero_is_0 = np.rint(-lo / ((hi - lo) / maxq)) == 0
        levels = np.where(zero_is_0 & (self.zero_offset == 1), maxq - 1, maxq)
        tiny = ml_dtypes.finfo(self.scale_dtype.np).smallest_subnormal  # type: ignore[no-untyped-call]
        scale = np.maximum((hi - lo) / levels, tiny).astype(self.scale_dtype.np)
        s32 = scale.astype(np.float32)
        zero = np.clip(np.rint(-lo / s32), self.zero_offset, maxq)
        q = np.clip(np.rint(w / s32[:, g_idx]) + zero[:, g_idx], 0, maxq).astype(np.uint32)
        bufs = {
            "weight": pack_codes(q, self.bits),
            "zeros": (zero - self.zero_offset).astype(np.uint8),
            "scales": scale,
        }
        if self.act_order:
            bufs["g_idx"] = g_idx
        return bufs

    def bytes_per_weight(self) -> float:
        # Codes plus one scale and one zero byte per group; g_idx is shared by every row.
        return self.bits / 8 + (self.scale_dtype.itemsize + 1) / self.group_size

    @property
    def fragment(self) -> str:
        return "gptq"


def _u32(a: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    check_tensor(a, name, shape, np.int32, np.uint32)
    return a.view(np.uint32)


def repack(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray | None,
    bits: int,
    group_size: int,
    checkpoint_format: str,
    where: str,
) -> tuple[Gptq, int, int, dict[str, np.ndarray]]:
    """Checkpoint tensors into the kernel layout; group_size -1 means one group per row.

    The format uses act_order=1 only when g_idx is not the trivial i // group_size map, so
    desc_act checkpoints whose map happens to be trivial get the faster kernel."""
    if bits not in BITS:
        raise FormatError(f"not supported: GPTQ {bits}-bit ({where})")
    if qweight.ndim != 2:
        raise FormatError(f"{where}.qweight: {qweight.ndim}-D, expected int32 [in*bits/32, out]")
    in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
    if qweight.shape[0] * 32 % bits:
        raise FormatError(f"{where}.qweight: {qweight.shape[0]} rows do not hold whole codes")
    g = in_features if group_size == -1 else group_size
    trivial = np.arange(in_features) // g
    if g_idx is not None and (g_idx.dtype != np.int32 or tuple(g_idx.shape) != (in_features,)):
        raise FormatError(
            f"{where}.g_idx: {g_idx.dtype} {list(g_idx.shape)}, expected int32 [{in_features}]"
        )
    act_order = int(g_idx is not None and not np.array_equal(g_idx, trivial))
    scale_dtype = dtype_among(scales.dtype, SCALE_DTYPES, f"{where}.scales")
    fmt = Gptq(bits, g, checkpoint_format, act_order, scale_dtype)
    if g_idx is not None and scales.ndim == 2 and scales.shape[0] > fmt.group_count(in_features):
        # a K part of an act-order weight keeps the whole's groups (qir.models.quant_conventions.gptq)
        act_order = 1
        fmt = replace(fmt, act_order=1).holding(scales.shape[0], in_features)
    fmt.check_read_shape(out_features, in_features, f"{where}.qweight")
    if out_features * bits % 32:
        raise FormatError(
            f"{where}.qzeros: {out_features} output channels x {bits} bits do not fill whole "
            "int32 words"
        )
    n = fmt.group_count(in_features)
    qw = _u32(qweight, f"{where}.qweight", (in_features * bits // 32, out_features))
    qz = _u32(qzeros, f"{where}.qzeros", (n, out_features * bits // 32))
    if tuple(scales.shape) != (n, out_features):
        raise FormatError(
            f"{where}.scales: shape {list(scales.shape)}, expected {[n, out_features]} "
            f"(group size {g})"
        )
    bufs = {
        "weight": np.ascontiguousarray(qw.T),
        "zeros": np.ascontiguousarray(unpack_codes(qz, bits, out_features).T.astype(np.uint8)),
        "scales": np.ascontiguousarray(scales.T),
    }
    if act_order:
        assert g_idx is not None
        bufs["g_idx"] = np.asarray(g_idx)
    fmt.check_buffers(bufs, out_features, in_features, where)
    return fmt, out_features, in_features, bufs
