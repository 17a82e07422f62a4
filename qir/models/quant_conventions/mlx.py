"""mlx-lm checkpoints: `<module>.weight/.scales/.biases`, read as stored (no repack)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.formats import mlx
from qir.formats.base import dtype_among
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import tensor
from qir.models.quant_conventions.dense import read_dense
from qir.types import QWeight


def _mlx_linear(ck: CheckpointView, module: str) -> Linear:
    qcfg = mlx.quantization_dict(ck.config)
    assert qcfg is not None  # the convention matched on it
    if qcfg.get(module) is False:  # mlx-lm left this module unquantized
        return read_dense(ck, module)
    scales = f"{module}.scales"
    words = tensor(ck, f"{module}.weight")
    tensor(ck, scales, "an MLX affine weight needs .weight/.scales/.biases")
    fmt = mlx.from_config(
        qcfg, module, dtype_among(ck.store.dtype(scales), mlx.SCALE_DTYPES, scales)
    )
    assert fmt is not None  # only a false entry leaves a module unquantized, read above
    if words.ndim != 2 or words.dtype != np.uint32 or words.shape[1] * 32 % fmt.bits:
        raise FormatError(
            f"{module}.weight: {words.dtype} {list(words.shape)}, expected uint32 "
            f"[out, in*{fmt.bits}/32] for {fmt.spell()}"
        )
    out_features, in_features = words.shape[0], words.shape[1] * 32 // fmt.bits
    fmt.check_read_shape(out_features, in_features, f"{module}.weight")
    bufs = {
        name: ck.store.get(f"{module}.{name}")
        for name in fmt.buffers(out_features, in_features)
        if f"{module}.{name}" in ck.store
    }
    fmt.check_buffers(bufs, out_features, in_features, where=module)
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _axes(config: Mapping[str, Any]) -> Axes:
    return {**OUT_IN, "scales": ("out", "in"), "biases": ("out", "in")}


register_convention(QuantConvention("mlx_affine", mlx.matches_config, _mlx_linear, axes=_axes))
