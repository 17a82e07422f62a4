"""FP8 E4M3 linears (`<module>.weight` e4m3 + `.weight_scale`), shared by compressed-tensors
`float-quantized` (see ct_float) and ModelOpt `quant_algo: FP8`, whose convention is here.

ModelOpt's FP8 is per-tensor: `weight_scale` and `input_scale` are float32 scalars (amax/448).
The input scale is not read: qir runs FP8 weight-only (see qir.formats.fp8).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import expect_matrix, modelopt_quant, tensors
from qir.models.quant_conventions.dense import is_excluded, read_dense
from qir.types import QWeight

_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def read_fp8(ck: CheckpointView, module: str, granularity: str) -> Linear:
    """`<module>.weight` e4m3 [O, I] and `.weight_scale` ([O, 1] or [O] per channel; [1] or []
    per tensor) in f32/f16/bf16, widened to float32 (exact)."""
    fmt = Fp8(granularity)
    name, scale_name = f"{module}.weight", f"{module}.weight_scale"
    needs = "an FP8 linear needs .weight and .weight_scale"
    w, s = tensors(ck, module, ("weight", "weight_scale"), needs)
    expect_matrix(w, name, ml_dtypes.float8_e4m3fn, "[out, in]")
    out_features, in_features = w.shape
    fmt.check_read_shape(out_features, in_features, name)
    rows = out_features if granularity == "channel" else 1
    if s.dtype not in _SCALE_DTYPES or s.size != rows or (s.ndim == 2 and s.shape[1] != 1):
        want = f"[{out_features}, 1]" if granularity == "channel" else "[1] or []"
        raise FormatError(
            f"{scale_name}: {s.dtype} {list(s.shape)}, expected a float {want} per-{granularity} "
            f"scale for a [{out_features}, {in_features}] weight"
        )
    return scaled_linear(module, fmt, w, s.reshape(rows), scale_name)


def scaled_linear(
    module: str, fmt: WeightFormat, w: np.ndarray, scale: np.ndarray, scale_name: str
) -> Linear:
    """An FP8 linear of e4m3 codes `w` and a scale read as `scale_name`, widened to float32
    (exact from f16/bf16), checked by the format with errors naming the checkpoint's tensor."""
    out_features, in_features = w.shape
    widened = scale.astype(np.float32)
    widened.flags.writeable = False  # like every buffer read from the checkpoint
    bufs = {"weight": w, "scale": widened}
    try:
        fmt.check_buffers(bufs, out_features, in_features, where=module)
    except FormatError as e:
        raise FormatError(str(e).replace(f"{module}.scale:", f"{scale_name}:")) from None
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def modelopt_matches(config: Mapping[str, Any]) -> bool:
    q = modelopt_quant(config)
    algo = q.get("quant_algo") if q is not None else None
    if not isinstance(algo, str) or not algo.startswith("FP8"):
        return False
    if algo != "FP8":
        # FP8_PB_WO (block scales), FP8_PER_CHANNEL_PER_TOKEN, ...: no checkpoint to verify.
        raise FormatError(f"not supported: ModelOpt quant_algo {algo} (only FP8, per-tensor)")
    return True


def _modelopt_linear(ck: CheckpointView, module: str) -> Linear:
    q = modelopt_quant(ck.config)
    assert q is not None  # the convention matched on it
    if is_excluded(module, q.get("ignore", q.get("exclude_modules"))):
        return read_dense(ck, module)
    return read_fp8(ck, module, "tensor")


def _axes(config: Mapping[str, Any]) -> Axes:
    # weight [O, I]; weight_scale per channel [O, 1] or [O] (per tensor: one element)
    return {**OUT_IN, "weight_scale": ("out", "")}


register_convention(QuantConvention("fp8_modelopt", modelopt_matches, _modelopt_linear, axes=_axes))
