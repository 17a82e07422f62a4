"""NVFP4: E2M1 codes with one E4M3 scale per 16 inputs and one float32 per-tensor scale.

Three producers write it (docs/formats.md: the MLX, ModelOpt and compressed-tensors rows); one kernel layout holds them all:

| buffer              | type          | ModelOpt         | compressed-tensors   | MLX nvfp4            |
|---------------------|---------------|------------------|----------------------|----------------------|
| weight              | u8 [O, I/2]   | weight           | weight_packed        | weight (u32 bytes)   |
| block_scale         | u8 [O, I/16]  | weight_scale     | weight_scale         | scales               |
| global_scale        | f32 [1]       | weight_scale_2   | weight_global_scale  | global_scale/2688, 1 |
| input_scale (W4A4)  | f32 [1]       | input_scale      | input_global_scale   | -                    |

Element 2k of a row is the low nibble of byte k everywhere (MLX's little-endian u32 words are the
same bytes). The per-tensor scales are kept exactly as the producer stored them, because the
tools disagree on what they mean: ModelOpt (and MLX) store decode factors and multiply
(`scale_mode="mul"`), compressed-tensors stores the reciprocal encode factor and divides
(`scale_mode="div"`). Both decoders first fold the block scale with the per-tensor scale and then
multiply the E2M1 value: w = e2m1 * (s_b * g) or e2m1 * (s_b / g). That order reproduces each
tool's float32 decode bit for bit; a reciprocal taken at load time (1/g, as CT's ModelOpt
converter does) would move about a third of the weights by an ulp, and would change a few E2M1
codes of ModelOpt's activation quantization (54 of 94208 in the modelopt_nvfp4_S fixture), whose
ties depend on the exact value of x/(s_b*input_scale).

`act_bits=4` records that the checkpoint calibrated its activations for 4-bit (W4A4); the layer's
input scale then travels with the weight and `quantize_activation` fake-quantizes an input the
way that producer's runtime does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from qir.dtypes import F32, U8
from qir.errors import FormatError
from qir.formats.base import ParamTable, WeightFormat, refuse_codes
from qir.formats.fp_codes import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_CODES,
    e2m1_decode,
    e2m1_encode_rne,
    e4m3_decode,
    e4m3_encode,
    pack_fp4,
    unpack_fp4,
)
from qir.formats.registry import register, register_act_quantizer
from qir.types import TensorType

GROUP_SIZE = 16
SCALE_MODES = ("mul", "div")
ACT_BITS = (4, 16)
# Largest magnitude an NVFP4 block can hold with a full-range block scale: 6 * 448.
FP4_RANGE = np.float32(E2M1_MAX * E4M3_MAX)
# MLX's nvfp4 `global_scale` is the tensor amax; its decode factor is global_scale / 2688.
MLX_GLOBAL_DIVISOR = np.float32(E2M1_MAX * E4M3_MAX)
# ModelOpt clamps a block's decode scale from below at the smallest E4M3 subnormal.
_E4M3_MIN_SUBNORMAL = np.float32(2.0**-9)

_f32 = np.float32


@register
@dataclass(frozen=True)
class Nvfp4(WeightFormat):
    kind: ClassVar[str] = "nvfp4"

    # "mul": global_scale/input_scale are decode factors amax/2688 (ModelOpt, MLX);
    # "div": they are encode factors 2688/amax (compressed-tensors).
    scale_mode: str
    # 4 when the checkpoint calibrated 4-bit activations (W4A4), else 16.
    act_bits: int

    allowed: ClassVar[ParamTable] = {"scale_mode": SCALE_MODES, "act_bits": ACT_BITS}

    def tag(self) -> str:
        return f"nvfp4{self.scale_mode}" + ("a4" if self.act_bits == 4 else "")

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        bufs = {
            "weight": TensorType((out_features, in_features // 2), U8),
            "block_scale": TensorType((out_features, in_features // GROUP_SIZE), U8),
            "global_scale": TensorType((1,), F32),
        }
        if self.act_bits == 4:
            bufs["input_scale"] = TensorType((1,), F32)
        return bufs

    def input_multiple(self) -> tuple[int, str]:
        return GROUP_SIZE, "the NVFP4 block size"

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None:
        super().check_buffers(bufs, out_features, in_features, where)
        refuse_codes(bufs["block_scale"], E4M3_NAN_CODES, f"{where}.block_scale", "E4M3 NaN")
        for name in ("global_scale", "input_scale"):
            if name in bufs and name in self.buffers(out_features, in_features):
                v = float(np.asarray(bufs[name]).reshape(-1)[0])
                if not v > 0:
                    raise FormatError(f"{where}.{name}: {v}, expected a positive scale")

    def block_factors(self, bufs: Mapping[str, np.ndarray]) -> np.ndarray:
        """float32 [O, I/16] decode factor of each block: block scale folded with the global."""
        s = e4m3_decode(np.asarray(bufs["block_scale"]))
        g = _f32(np.asarray(bufs["global_scale"]).reshape(-1)[0])
        return s * g if self.scale_mode == "mul" else s / g

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        e = e2m1_decode(unpack_fp4(np.asarray(bufs["weight"]), in_features))
        e = e.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        w = e * self.block_factors(bufs)[..., None]
        result: np.ndarray = w.reshape(out_features, in_features)
        return result

    def quantize(
        self,
        w: np.ndarray,
        *,
        global_amax: float | None = None,
        input_amax: float | None = None,
    ) -> dict[str, np.ndarray]:
        """ModelOpt / compressed-tensors weight quantization (identical codes and block scales).

        The per-tensor scale comes from `global_amax` when given: producers share one across
        q/k/v and gate/up (the max amax of the group), so it may exceed amax(w). A W4A4 format
        also needs the calibrated activation amax, `input_amax`.
        """
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        amax = _f32(np.abs(w).max()) if global_amax is None else _f32(global_amax)
        if amax < np.abs(w).max():
            raise FormatError(f"{self.spell()}: global_amax {amax} is below max|w|")
        # An all-zero tensor still needs a usable (positive) global scale.
        amax = amax if amax > 0 else _f32(1)
        blocks = w.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        amax_b = np.abs(blocks).max(axis=-1)
        if self.scale_mode == "mul":
            g = amax / FP4_RANGE
            s = e4m3_decode(e4m3_encode(amax_b / (_f32(E2M1_MAX) * g)))
        else:
            g = FP4_RANGE / amax
            s = e4m3_decode(e4m3_encode(amax_b / _f32(E2M1_MAX) * g))
        # A block whose scale rounds to zero holds (near-)zeros; any positive scale codes them 0.
        s = np.where(s == 0, _f32(1), s)
        bufs = {
            "weight": np.empty(0, np.uint8),
            "block_scale": e4m3_encode(s),
            "global_scale": np.array([g], dtype=np.float32),
        }
        codes = e2m1_encode_rne(blocks / self.block_factors(bufs)[..., None])
        bufs["weight"] = pack_fp4(codes.reshape(out_features, in_features))
        if self.act_bits == 4:
            if input_amax is None or not input_amax > 0:
                raise FormatError(f"{self.spell()}: quantize needs a positive input_amax (W4A4)")
            a = _f32(input_amax)
            scale = a / FP4_RANGE if self.scale_mode == "mul" else FP4_RANGE / a
            bufs["input_scale"] = np.array([scale], dtype=np.float32)
        return bufs

    def quantize_activation(self, x: np.ndarray, bufs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Fake-quantized input of this weight in its producer's arithmetic (W4A4 formats only)."""
        if self.act_bits != 4:
            raise FormatError(f"{self.spell()}: a W4A16 weight has no calibrated input scale")
        scale = float(np.asarray(bufs["input_scale"]).reshape(-1)[0])
        if self.scale_mode == "mul":
            return quantize_activation_nvfp4(x, input_scale=scale)
        return quantize_activation_nvfp4(x, scale)

    def act_quant_scheme(self) -> str | None:
        return "nvfp4"

    def declared_act_bits(self) -> int:
        return self.act_bits

    def act_quant_rule(self, bufs: Mapping[str, np.ndarray]) -> dict[str, float]:
        """The calibrated input scale as stored, named by its convention: ModelOpt's decode
        factor (`input_scale`) or CT's encode factor (`input_global_scale`); inverting one into
        the other is not exact (see the module docstring)."""
        attr = self.act_scale_attr()
        if attr is None:
            return {}
        return {attr: float(np.asarray(bufs["input_scale"]).reshape(-1)[0])}

    def act_scale_attr(self) -> str | None:
        if self.act_bits != 4:
            return None
        return "input_scale" if self.scale_mode == "mul" else "input_global_scale"

    def bytes_per_weight(self) -> float:
        return 0.5 + 1 / GROUP_SIZE

    @property
    def fragment(self) -> str:
        return "nvfp4"


def quantize_activation_nvfp4(
    x: np.ndarray, input_global_scale: float | None = None, *, input_scale: float | None = None
) -> np.ndarray:
    """NVFP4 fake quantization of activations [..., K]: float32, same shape.

    Per row, one dynamic E4M3 block scale per 16 consecutive K elements, clamped at 448, and a
    static per-tensor scale (vLLM `ref_nvfp4_quant`, CT `forward_quantize`):
    - `input_global_scale` (CT's encode factor 2688/amax): s_b = e4m3(min(amax_b/6 * gs, 448)),
      x_q = rne_e2m1(clamp(x / (s_b/gs), +-6)) * (s_b/gs). Bit-exact to compressed-tensors.
    - `input_scale` (ModelOpt's decode factor amax/2688): s_b = e4m3(clamp(amax_b/(6*is),
      2^-9, 448)), x_q = rne_e2m1(clamp(x / (s_b*is), +-6)) * (s_b*is). Bit-exact to ModelOpt's
      NVFP4QTensor; CT's order on ModelOpt's scales resolves a few exact E2M1 ties differently.
    - neither: each row gets its own encode factor 2688/amax_row (CT order).
    """
    if input_global_scale is not None and input_scale is not None:
        raise ValueError("quantize_activation_nvfp4: give input_global_scale or input_scale")
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % GROUP_SIZE:
        raise ValueError(f"quantize_activation_nvfp4: K={k} is not a multiple of {GROUP_SIZE}")
    xb = x.reshape(*x.shape[:-1], k // GROUP_SIZE, GROUP_SIZE)
    amax_b = np.abs(xb).max(axis=-1, keepdims=True)
    if input_scale is not None:
        i_s = _f32(input_scale)
        raw = np.clip(amax_b / (_f32(E2M1_MAX) * i_s), _E4M3_MIN_SUBNORMAL, _f32(E4M3_MAX))
        factor = e4m3_decode(e4m3_encode(raw)) * i_s
    else:
        if input_global_scale is not None:
            gs = np.asarray(input_global_scale, dtype=np.float32)
        else:
            row_amax = np.abs(x).max(axis=-1, keepdims=True)[..., None]
            gs = FP4_RANGE / np.where(row_amax > 0, row_amax, _f32(1)).astype(np.float32)
        s = e4m3_decode(e4m3_encode(np.minimum(amax_b / _f32(E2M1_MAX) * gs, _f32(E4M3_MAX))))
        # An all-zero block has scale 0; any positive scale codes it as zeros.
        factor = np.where(s == 0, _f32(1), s).astype(np.float32) / gs
    q = e2m1_decode(e2m1_encode_rne(xb / factor))
    return (q * factor).reshape(x.shape)


register_act_quantizer("nvfp4", quantize_activation_nvfp4)
