"""FP8 E4M3 weights with one float32 scale per 128 x 128 block (docs/formats.md: the FP8 rows): the layout of
the official Qwen3-*-FP8 and DeepSeek-V3 releases and of compressed-tensors' FP8_BLOCK scheme.

| buffer | kernel layout            | HF `quant_method: fp8`                  | compressed-tensors FP8_BLOCK        |
|--------|--------------------------|-----------------------------------------|-------------------------------------|
| weight | e4m3 [O, I]              | weight                                  | weight                              |
| scale  | f32 [ceil(O/128), ceil(I/128)] | weight_scale_inv (f32; despite the name, a multiplier) | weight_scale (model dtype) |

Decode w[o, i] = e4m3[o, i] * scale[o // 128, i // 128]; the last row and column blocks are
ragged when O or I is not a multiple of 128 (transformers' FineGrainedFP8 dequant and DeepSeek's
`weight_dequant` index the same way). Scales stored in bf16/f16 widen to float32 exactly.

Weight-only like qir.formats.fp8: the producers also quantize activations per token-group of
128 at run time; qir keeps them 16-bit, so results are x @ W^T of the decoded weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from qir.dtypes import E4M3, F32
from qir.errors import FormatError
from qir.formats.base import Allowed, ParamTable, WeightFormat
from qir.formats.fp_codes import E4M3_MAX, e4m3_decode, e4m3_encode
from qir.formats.registry import register
from qir.types import TensorType

BLOCK = 128
_BLOCK_RULE = Allowed(
    (BLOCK,),
    refusal="not supported: FP8 weight_block_size {value} (qir reads 128 x 128 blocks)",
)


def blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


@register
@dataclass(frozen=True)
class Fp8Block(WeightFormat):
    kind: ClassVar[str] = "fp8_block"

    block_out: int = BLOCK  # rows per scale block
    block_in: int = BLOCK  # inputs per scale block

    allowed: ClassVar[ParamTable] = {"block_out": _BLOCK_RULE, "block_in": _BLOCK_RULE}

    def tag(self) -> str:
        return f"fp8b{self.block_out}x{self.block_in}"

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        return {
            "weight": TensorType((out_features, in_features), E4M3),
            "scale": TensorType(
                (blocks(out_features, self.block_out), blocks(in_features, self.block_in)), F32
            ),
        }

    def expand_scale(self, scale: np.ndarray, out_features: int, in_features: int) -> np.ndarray:
        """The float32 [O, I] scale of every weight element (ragged last blocks cut)."""
        s = np.asarray(scale, dtype=np.float32)
        s = np.repeat(np.repeat(s, self.block_out, axis=0), self.block_in, axis=1)
        return s[:out_features, :in_features]

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        # check_buffers refuses E4M3 NaN codes (0x7F/0xFF) in the weight and non-finite scales.
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        codes = e4m3_decode(np.asarray(bufs["weight"]))
        result: np.ndarray = codes * self.expand_scale(bufs["scale"], out_features, in_features)
        return result

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """scale = amax / 448 per block (the producers' symmetric min-max rule), codes =
        e4m3(w / scale) rounded to nearest even. An all-zero block gets scale 1."""
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        ro, ri = blocks(out_features, self.block_out), blocks(in_features, self.block_in)
        padded = np.zeros((ro * self.block_out, ri * self.block_in), np.float32)
        padded[:out_features, :in_features] = np.abs(w)
        amax = padded.reshape(ro, self.block_out, ri, self.block_in).max(axis=(1, 3))
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
        codes = e4m3_encode(w / self.expand_scale(scale, out_features, in_features))
        return {"weight": codes.view(ml_dtypes.float8_e4m3fn), "scale": scale}

    def row_unit(self) -> int:
        return self.block_out

    def column_unit(self, in_features: int) -> int:
        return self.block_in

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]:
        """A K shard: the scale columns of the blocks it covers, which index the part's inputs
        as the whole weight's only when it starts on a block and ends on one (or at K)."""
        b = self.block_in
        if start % b or (stop % b and stop != in_features) or not 0 <= start < stop <= in_features:
            raise FormatError(
                f"{where}.scale: a K split {start}..{stop} of in_features {in_features} is not "
                f"on its blocks of {b} inputs, so it cannot be exact"
            )
        last = -(-stop // b)
        return {
            "weight": bufs["weight"][:, start:stop],
            "scale": bufs["scale"][:, start // b : last],
        }

    def rows(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
    ) -> dict[str, np.ndarray]:
        """Rows start..stop as views: the scale rows of the blocks they cover, which index the
        part's rows as the whole weight's only when the part starts a block or lies in one."""
        first, last = start // self.block_out, (stop - 1) // self.block_out
        if start % self.block_out and first != last:
            raise FormatError(
                f"{self.spell()}: rows {start}..{stop} start inside scale block {first} and "
                f"end in block {last}; a part must start at a multiple of {self.block_out}"
            )
        return {"weight": bufs["weight"][start:stop], "scale": bufs["scale"][first : last + 1]}

    def describe(self) -> dict[str, Any]:
        return {"bits": 8, "group": self.block_in, "w4a4": False}

    def bytes_per_weight(self) -> float:
        return 1.0 + 4.0 / (self.block_out * self.block_in)

    @property
    def fragment(self) -> str:
        return "fp8_block"
