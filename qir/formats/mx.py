"""OCP microscaling (MX v1.0) weights: MXFP4 (E2M1) and MXFP8 (E4M3) elements with one E8M0
scale per 32 consecutive inputs of a row (docs/formats.md: the MLX and MXFP4 rows).

| buffer | mxfp4         | mxfp8          | compressed-tensors mxfp4 | MLX mxfp4 / mxfp8             |
|--------|---------------|----------------|--------------------------|-------------------------------|
| weight | u8 [O, I/2]   | e4m3 [O, I]    | weight_packed            | weight (u32 words, same bytes)|
| scales | u8 [O, I/32]  | u8 [O, I/32]   | weight_scale             | scales                        |

FP4 codes are packed low nibble first (element 2k in the low nibble of byte k) by every
producer, and MLX's little-endian uint32 words hold exactly those bytes, so both checkpoint
conventions share one kernel layout and need no repack: the loaders only reinterpret bytes.
A scale byte e is a biased exponent: w = element * 2^(e - 127); e = 255 is NaN and refused.

Weight-only: compressed-tensors' MXFP4 (W4A4) scheme also quantizes activations dynamically
per 32-block at run time; qir keeps activations 16-bit, so such a checkpoint runs as MXFP4A16.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from qir.dtypes import E4M3, U8
from qir.formats.base import WeightFormat, refuse_codes
from qir.formats.fp_codes import (
    e2m1_decode,
    e2m1_encode_rne,
    e4m3_decode,
    e4m3_encode,
    pack_fp4,
    unpack_fp4,
)
from qir.formats.registry import register
from qir.types import TensorType

GROUP_SIZE = 32
E8M0_NAN = 0xFF
# Exponent of the largest element value: 6 = 1.5 * 2^2 (E2M1), 448 = 1.75 * 2^8 (E4M3).
E2M1_EMAX = 2
E4M3_EMAX = 8


def e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """float32 2^(e-127) of E8M0 bytes; 0 is the float32 subnormal 2^-127, 255 is NaN."""
    result: np.ndarray = (
        np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    )
    return result


def ocp_scale_exponents(blocks: np.ndarray, elem_emax: int) -> np.ndarray:
    """E8M0 bytes [..., n] of float32 blocks [..., n, 32]: the OCP MX reference rule.

    microsoft/microxcaling `_quantize_mx`: shared exponent floor(log2(amax)) - elem_emax, so the
    block's largest magnitude lands in the element format's top binade, where values above the
    format maximum saturate. compressed-tensors rounds amax to one mantissa bit first and MLX
    uses ceil(log2(amax/6)), so their bytes differ for some blocks; the decoded error bounds are
    what is comparable. An all-zero block gets the smallest scale, as in the reference.
    """
    amax = np.abs(blocks).max(axis=-1)
    # frexp is exact: amax = m * 2^ex with m in [0.5, 1), so floor(log2(amax)) = ex - 1.
    _, ex = np.frexp(amax)
    biased = np.where(amax > 0, ex.astype(np.int64) - 1 - elem_emax + 127, 0)
    return np.clip(biased, 0, 254).astype(np.uint8)


@dataclass(frozen=True)
class _Mx(WeightFormat):
    """What MXFP4 and MXFP8 share: the E8M0 scale per 32, its checks and its quantizer."""

    elem_bits: ClassVar[int]

    def tag(self) -> str:
        return self.kind

    def input_multiple(self) -> tuple[int, str]:
        return GROUP_SIZE, "the MX block size"

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None:
        super().check_buffers(bufs, out_features, in_features, where)
        refuse_codes(bufs["scales"], (E8M0_NAN,), f"{where}.scales", "E8M0 NaN")

    def describe(self) -> dict[str, Any]:
        return {"bits": self.elem_bits, "group": GROUP_SIZE, "w4a4": False}

    def bytes_per_weight(self) -> float:
        return self.elem_bits / 8 + 1 / GROUP_SIZE

    @property
    def fragment(self) -> str:
        return self.kind

    def _blocks(self, w: np.ndarray) -> np.ndarray:
        w = self._quantize_input(w)
        return w.reshape(w.shape[0], -1, GROUP_SIZE)

    @abstractmethod
    def _element_values(self, bufs: Mapping[str, np.ndarray], in_features: int) -> np.ndarray:
        """float32 element values [O, I] of the weight buffer (before scaling)."""

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        elems = self._element_values(bufs, in_features).reshape(out_features, -1, GROUP_SIZE)
        # One float32 product per weight, like the kernels and the producers' float32 decode.
        w = elems * e8m0_decode(np.asarray(bufs["scales"]))[..., None]
        result: np.ndarray = w.reshape(out_features, in_features)
        return result


@register
@dataclass(frozen=True)
class Mxfp4(_Mx):
    kind: ClassVar[str] = "mxfp4"
    elem_bits: ClassVar[int] = 4

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        return {
            "weight": TensorType((out_features, in_features // 2), U8),
            "scales": TensorType((out_features, in_features // GROUP_SIZE), U8),
        }

    def _element_values(self, bufs: Mapping[str, np.ndarray], in_features: int) -> np.ndarray:
        return e2m1_decode(unpack_fp4(np.asarray(bufs["weight"]), in_features))

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """OCP MX reference quantizer (see ocp_scale_exponents); elements round to nearest even
        and saturate at +-6."""
        blocks = self._blocks(w)
        e = ocp_scale_exponents(blocks, E2M1_EMAX)
        # Dividing by a power of two is exact, so only the E2M1 rounding loses information.
        codes = e2m1_encode_rne(blocks / e8m0_decode(e)[..., None])
        return {"weight": pack_fp4(codes.reshape(blocks.shape[0], -1)), "scales": e}


@register
@dataclass(frozen=True)
class Mxfp8(_Mx):
    kind: ClassVar[str] = "mxfp8"
    elem_bits: ClassVar[int] = 8

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        return {
            "weight": TensorType((out_features, in_features), E4M3),
            "scales": TensorType((out_features, in_features // GROUP_SIZE), U8),
        }

    def _element_values(self, bufs: Mapping[str, np.ndarray], in_features: int) -> np.ndarray:
        return e4m3_decode(np.asarray(bufs["weight"]))

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """OCP MX reference quantizer (see ocp_scale_exponents); elements round to nearest even
        and saturate at +-448."""
        blocks = self._blocks(w)
        e = ocp_scale_exponents(blocks, E4M3_EMAX)
        codes = e4m3_encode(blocks / e8m0_decode(e)[..., None])
        weight = codes.reshape(blocks.shape[0], -1).view(ml_dtypes.float8_e4m3fn)
        return {"weight": weight, "scales": e}
