"""FP8 E4M3 weights with one float scale per output row or per tensor (docs/formats.md: the FP8 rows).

| buffer | channel     | tensor     | compressed-tensors float-quantized      | ModelOpt quant_algo FP8 |
|--------|-------------|------------|-----------------------------------------|-------------------------|
| weight | e4m3 [O, I] | e4m3 [O, I]| weight                                  | weight                  |
| scale  | f32 [O]     | f32 [1]    | weight_scale [O, 1] / [1] (model dtype) | weight_scale [] f32     |

Decode w = e4m3 * scale. Checkpoints store the scale in the model dtype (llmcompressor's
FP8_DYNAMIC writes bf16) or f32; widening to f32 is exact, so one f32 kernel layout holds all.

Weight-only FP8: the producers also quantize activations to FP8 (dynamic per token, or with a
static input_scale) for FP8 tensor-core GEMMs. qir runs the GEMV with 16-bit activations and
dequantized weights, so its results are the weight-only product x @ W^T (the fixtures' goldens),
not the W8A8 one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from qir.dtypes import E4M3, F32
from qir.formats.base import ParamTable, WeightFormat
from qir.formats.fp_codes import E4M3_MAX, e4m3_decode, e4m3_encode
from qir.formats.registry import register
from qir.types import TensorType

GRANULARITIES = ("channel", "tensor")


@register
@dataclass(frozen=True)
class Fp8(WeightFormat):
    kind: ClassVar[str] = "fp8"

    granularity: str  # "channel": one scale per output row; "tensor": one for the weight

    allowed: ClassVar[ParamTable] = {"granularity": GRANULARITIES}

    def tag(self) -> str:
        return "fp8ch" if self.granularity == "channel" else "fp8t"

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        rows = out_features if self.granularity == "channel" else 1
        return {
            "weight": TensorType((out_features, in_features), E4M3),
            "scale": TensorType((rows,), F32),
        }

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        # check_buffers refuses E4M3 NaN codes (0x7F/0xFF) in the weight and non-finite scales.
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        scale = np.asarray(bufs["scale"], dtype=np.float32)[:, None]
        return e4m3_decode(np.asarray(bufs["weight"])) * scale

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """scale = amax / 448 per row or tensor (llmcompressor's memoryless min-max observer,
        symmetric), codes = e4m3(w / scale) rounded to nearest even. An all-zero row or tensor
        gets scale 1, which codes it as zeros."""
        w = self._quantize_input(w)
        if self.granularity == "channel":
            amax = np.abs(w).max(axis=1)
        else:
            amax = np.abs(w).max(keepdims=True).reshape(1)
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
        codes = e4m3_encode(w / scale[:, None])
        return {"weight": codes.view(ml_dtypes.float8_e4m3fn), "scale": scale}

    def describe(self) -> dict[str, Any]:
        return {"bits": 8, "group": None, "w4a4": False}

    def bytes_per_weight(self) -> float:
        # The per-row scale is amortised over a whole row; count the codes only.
        return 1.0

    @property
    def fragment(self) -> str:
        return "fp8"
