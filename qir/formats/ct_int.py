"""compressed-tensors `pack-quantized` symmetric int weights (W4A16 / W8A16 schemes).

Checkpoint = kernel layout, read as stored (zero-copy views):

  weight [O, I*bits/32]  uint32 (stored int32 `weight_packed`)  element i at bits
                         bits*(i % (32/bits)) of word i // (32/bits), offset-binary q + 2^(bits-1)
  scales [O, I/g]        scale_dtype (the model dtype; stored `weight_scale`)

Decode: `(code - 2^(bits-1)) * scale`. strategy "channel" is one group per row, so the family
passes group_size = in_features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from qir.dtypes import BF16, F16, F32, U32, DType
from qir.errors import FormatError
from qir.formats.base import Allowed, ParamTable, WeightFormat
from qir.formats.bitstream import pack_codes, unpack_codes
from qir.formats.registry import register
from qir.types import TensorType

BITS = (4, 8)
SCALE_DTYPES = (BF16, F16, F32)
# compressed-tensors replaces a zero scale by this so that quantizing divides safely.
_EPS = np.finfo(np.float32).eps


@register
@dataclass(frozen=True)
class CtInt(WeightFormat):
    kind: ClassVar[str] = "ct_int"

    bits: int
    group_size: int
    scale_dtype: DType

    allowed: ClassVar[ParamTable] = {
        "bits": Allowed(
            BITS,
            refusal="not supported: compressed-tensors pack-quantized {value}-bit int "
            "(expected {expected})",
        ),
        "group_size": Allowed(test=lambda g: g >= 8 and g % 8 == 0, expected="a multiple of 8"),
        "scale_dtype": SCALE_DTYPES,
    }

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1)

    def tag(self) -> str:
        return f"ct{self.bits}g{self.group_size}{self.scale_dtype.name}"

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        return {
            "weight": TensorType((out_features, in_features * self.bits // 32), U32),
            "scales": TensorType((out_features, in_features // self.group_size), self.scale_dtype),
        }

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        q = unpack_codes(np.asarray(bufs["weight"]), self.bits, in_features).astype(np.float32)
        s = np.asarray(bufs["scales"]).astype(np.float32)[..., None]
        w = (q.reshape(out_features, -1, self.group_size) - np.float32(self.offset)) * s
        return w.reshape(out_features, in_features)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """compressed-tensors' symmetric min/max quantizer (calculate_qparams + quantize):
        scale = max(|min|, |max|) / ((2^bits - 1) / 2), q = clamp(round(w / scale), -2^(b-1),
        2^(b-1) - 1), with the scale rounded to the model dtype before the codes are taken."""
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        g = w.reshape(out_features, -1, self.group_size)
        amax = np.maximum(-np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0))
        scale = amax / np.float32(((1 << self.bits) - 1) / 2)
        scale = np.where(scale == 0, _EPS, scale).astype(self.scale_dtype.np)
        s32 = scale.astype(np.float32)[..., None]
        q = np.clip(np.rint(g / s32), -self.offset, self.offset - 1) + self.offset
        return {
            "weight": pack_codes(q.astype(np.uint32).reshape(out_features, in_features), self.bits),
            "scales": scale,
        }

    def column_unit(self, in_features: int) -> int:
        # one group per row (strategy "channel") is every K part's: whole words of codes, 8 at
        # a time as the kernels read them
        return 8 if self.group_size >= in_features else self.group_size

    def column_part(self, in_features: int, start: int, stop: int) -> WeightFormat:
        if self.group_size >= in_features:
            return replace(self, group_size=stop - start)  # the row's one scale, for its width
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
        """A K shard, `self` the part's format (column_part): of a weight with one scale per row
        (strategy "channel"), its codes and every row's scale, else the groups it covers."""
        if np.shape(bufs["scales"])[-1] != 1 or self.group_size >= in_features:
            return super().columns(bufs, out_features, in_features, start, stop, where)
        if start % 8 or stop % 8 or not 0 <= start < stop <= in_features:
            raise FormatError(
                f"{where}: a K split {start}..{stop} of in_features {in_features} is not on "
                "8-input words, so it cannot be exact"
            )
        words = bufs["weight"][:, start * self.bits // 32 : stop * self.bits // 32]
        return {"weight": words, "scales": bufs["scales"]}

    def bytes_per_weight(self) -> float:
        return self.bits / 8 + self.scale_dtype.itemsize / self.group_size

    @property
    def fragment(self) -> str:
        return "ct_int"
