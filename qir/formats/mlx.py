"""MLX affine quantization (`mx.quantize(mode="affine")`, mlx-lm checkpoints).

Each row of a weight [O, I] is cut into groups of `group_size` along I; a group stores one scale
and one bias, and element j of a row is a `bits`-wide code at bits [j*bits, (j+1)*bits) of the
row's little-endian uint32 bitstream (qir.formats.bitstream), so 3/5/6-bit codes straddle bytes
and words. Decode is `q*scale + bias`. The kernel reads the checkpoint tensors as stored: there
is no repack.

mlx-lm's `quantization` dict is read here too (`quantization_dict`, `module_quantization`), for
this format and for the other MLX modes (mxfp4/mxfp8, nvfp4) whose families share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from qir.dtypes import BF16, F16, F32, U32, DType
from qir.errors import FormatError
from qir.formats.base import ParamTable, WeightFormat
from qir.formats.bitstream import pack_codes, unpack_codes
from qir.formats.registry import register
from qir.types import TensorType

BITS = (1, 2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (F16, BF16, F32)
# What mlx's `to_quantized(group_size=None, bits=None)` falls back to for mode "affine"; mlx-lm
# writes `null` for them in per-module overrides when --q-group-size/--q-bits were not given.
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64

_EPS = np.float32(1e-7)


@register
@dataclass(frozen=True)
class MlxAffine(WeightFormat):
    kind: ClassVar[str] = "mlx_affine"

    bits: int
    group_size: int
    scale_dtype: DType

    allowed: ClassVar[ParamTable] = {
        "bits": BITS,
        "group_size": GROUP_SIZES,
        "scale_dtype": SCALE_DTYPES,
    }

    def tag(self) -> str:
        return f"mlx{self.bits}g{self.group_size}{self.scale_dtype.name}"

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        groups = in_features // self.group_size
        return {
            "weight": TensorType((out_features, in_features * self.bits // 32), U32),
            "scales": TensorType((out_features, groups), self.scale_dtype),
            "biases": TensorType((out_features, groups), self.scale_dtype),
        }

    # check_shape: in_features a multiple of the group size, itself a multiple of 32, so every
    # row fills whole uint32 words at any width.

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        self.check_buffers(bufs, out_features, in_features, where=self.spell())
        q = unpack_codes(np.asarray(bufs["weight"]), self.bits, in_features)
        shape = (out_features, in_features // self.group_size, self.group_size)
        # Widening bf16/f16 to f32 is exact; MLX's own dequantize rounds q*s+b to the scale dtype,
        # its quantized matmul does not, and the latter is what the kernels must match.
        s = np.asarray(bufs["scales"]).astype(np.float32)[..., None]
        b = np.asarray(bufs["biases"]).astype(np.float32)[..., None]
        w = q.astype(np.float32).reshape(shape) * s + b
        return w.reshape(out_features, in_features)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """MLX's CPU affine quantizer (mlx/backend/cpu/quantized.cpp), same codes on float32 input."""
        w = self._quantize_input(w)
        out_features, in_features = w.shape
        g = w.reshape(out_features, in_features // self.group_size, self.group_size)
        w_max = g.max(axis=-1, keepdims=True)
        w_min = g.min(axis=-1, keepdims=True)
        n_bins = np.float32((1 << self.bits) - 1)
        if self.bits == 1:
            # MLX maps the two codes straight onto the group's min and max.
            scale = np.maximum(w_max - w_min, _EPS)
            bias = w_min
        else:
            scale, bias = _edge_scale_bias(w_min, w_max, n_bins)
        # Codes use the unrounded float32 scale/bias; only the stored copies are rounded.
        q = np.clip(np.rint((g - bias) / scale), 0, n_bins).astype(np.uint32)
        return {
            "weight": pack_codes(q.reshape(out_features, in_features), self.bits),
            "scales": scale[..., 0].astype(self.scale_dtype.np),
            "biases": bias[..., 0].astype(self.scale_dtype.np),
        }

    def bytes_per_weight(self) -> float:
        return self.bits / 8 + 2 * self.scale_dtype.itemsize / self.group_size

    @property
    def fragment(self) -> str:
        return "mlx_affine"


def _edge_scale_bias(
    w_min: np.ndarray, w_max: np.ndarray, n_bins: np.float32
) -> tuple[np.ndarray, np.ndarray]:
    # The edge of larger magnitude becomes the bias and is hit exactly by code 0 (hence negative
    # scales when that edge is the max); everything stays in float32 like MLX.
    use_min = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, _EPS)
    scale = np.where(use_min, scale, -scale)
    edge = np.where(use_min, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale)
    bias = np.where(nonzero, edge, np.float32(0))
    return scale, bias


def _int_or_default(value: Any, default: int, key: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{key}: expected an integer, got {value!r}")
    return value


def module_quantization(
    qcfg: Mapping[str, Any], module: str
) -> tuple[Mapping[str, Any], str] | None:
    """The quantization parameters of `module` and where they come from, like mlx-lm's loader
    resolves them from its `quantization` dict; None if the module is left unquantized.

    An entry keyed by the module path wins: `false` leaves the module unquantized, `true` means
    the top-level parameters, and a dict replaces them wholesale.
    """
    override = qcfg.get(module, True)
    if override is False:
        return None
    if override is True:
        return qcfg, "quantization"
    if isinstance(override, Mapping):
        return override, f"quantization[{module!r}]"
    raise FormatError(f"quantization[{module!r}]: expected a dict or a bool, got {override!r}")


def from_config(qcfg: Mapping[str, Any], module: str, scale_dtype: DType) -> MlxAffine | None:
    """The format of `module` from mlx-lm's `quantization` dict, or None if it is left unquantized.

    The module's parameters come from module_quantization; a per-module dict's missing or null
    keys fall back to MLX's mode defaults, not to the top level.
    """
    found = module_quantization(qcfg, module)
    if found is None:
        return None
    params, where = found
    if params.get("mode") not in (None, "affine"):
        raise FormatError(f"not supported: MLX mode {params.get('mode')} ({where})")
    return MlxAffine(
        bits=_int_or_default(params.get("bits"), DEFAULT_BITS, f"{where}.bits"),
        group_size=_int_or_default(
            params.get("group_size"), DEFAULT_GROUP_SIZE, f"{where}.group_size"
        ),
        scale_dtype=scale_dtype,
    )


def quantization_dict(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """mlx-lm's quantization dict of a config.json (None if it has none of MLX's shape)."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if (
            isinstance(q, Mapping)
            and "quant_method" not in q
            and ("bits" in q or "group_size" in q)
        ):
            return q
    return None


def matches_config(config: Mapping[str, Any]) -> bool:
    """True for an mlx-lm affine checkpoint's config.json."""
    q = quantization_dict(config)
    return q is not None and q.get("mode") in (None, "affine")
