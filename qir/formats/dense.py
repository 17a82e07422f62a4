"""Unquantized weights: a plain f16/bf16/f32 W [O, I], as stored by the checkpoint.

Checkpoints leave some linears unquantized (compressed-tensors `ignore`, HF
`modules_to_not_convert`, mlx-lm per-module `false`, or no quantization at all). Giving them a
format of their own keeps one IR node (`qlinear`) and one GEMV for every linear.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from qir.dtypes import BF16, F16, F32, DType
from qir.errors import FormatError
from qir.formats.base import ParamTable, WeightFormat
from qir.formats.registry import register
from qir.types import TensorType

DTYPES = (F16, BF16, F32)


@register
@dataclass(frozen=True)
class Dense(WeightFormat):
    kind: ClassVar[str] = "dense"

    dtype: DType

    allowed: ClassVar[ParamTable] = {"dtype": DTYPES}

    def tag(self) -> str:
        return f"dense{self.dtype.name}"

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        return {"weight": TensorType((out_features, in_features), self.dtype)}

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        return np.asarray(bufs["weight"]).astype(np.float32)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """Rounds to the dtype (nearest even); refuses what would not be finite there."""
        w = self._quantize_input(w, finite=False)
        with np.errstate(over="ignore"):  # overflow is reported below, naming the format
            out = w.astype(self.dtype.np)
        if not np.all(np.isfinite(out.astype(np.float32))):
            raise FormatError(
                f"{self.spell()}: weight has values that are not finite in {self.dtype}"
            )
        return {"weight": out}

    def describe(self) -> dict[str, Any]:
        return {"bits": self.dtype.bits, "group": None, "w4a4": False}

    def bytes_per_weight(self) -> float:
        return float(self.dtype.itemsize)

    @property
    def fragment(self) -> str:
        return "dense"
