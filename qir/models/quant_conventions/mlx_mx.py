"""mlx-lm checkpoints in `mode: mxfp4` / `mode: mxfp8`: `<module>.weight` uint32 words of E2M1
codes ([O, I/8], element 2k in the low nibble of byte k) or raw E4M3 bytes ([O, I/4]), and
`<module>.scales` uint8 E8M0 [O, I/32]; no biases. The words are reinterpreted as the bytes of
the Mxfp4 / Mxfp8 kernel layout (no copy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats import mlx
from qir.formats.mx import GROUP_SIZE, Mxfp4, Mxfp8
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import matrix, tensor
from qir.models.quant_conventions.dense import read_dense
from qir.types import QWeight

# mode -> (format, element bits); MLX's defaults for a null bits/group_size are these too.
MODES: dict[str, tuple[Mxfp4 | Mxfp8, int]] = {"mxfp4": (Mxfp4(), 4), "mxfp8": (Mxfp8(), 8)}


def matches_config(config: Mapping[str, Any]) -> bool:
    q = mlx.quantization_dict(config)
    return q is not None and q.get("mode") in MODES


def _params(qcfg: Mapping[str, Any], module: str) -> tuple[Mxfp4 | Mxfp8, int] | None:
    """The module's format and element bits from its parameters (mlx.module_quantization: an
    entry keyed by the module path wins); None if unquantized."""
    found = mlx.module_quantization(qcfg, module)
    if found is None:
        return None
    params, where = found
    mode = params.get("mode")
    if mode not in MODES:
        raise FormatError(f"not supported: MLX mode {mode} in an mxfp4/mxfp8 checkpoint ({where})")
    fmt, bits = MODES[mode]
    if params.get("bits") not in (None, bits) or params.get("group_size") not in (None, GROUP_SIZE):
        raise FormatError(
            f"{where}: bits {params.get('bits')!r}, group_size {params.get('group_size')!r}; "
            f"MLX {mode} needs {bits} and {GROUP_SIZE}"
        )
    return fmt, bits


def _linear(ck: CheckpointView, module: str) -> Linear:
    qcfg = mlx.quantization_dict(ck.config)
    assert qcfg is not None  # the convention matched on it
    resolved = _params(qcfg, module)
    if resolved is None:
        return read_dense(ck, module)
    fmt, bits = resolved
    names = {b: f"{module}.{b}" for b in ("weight", "scales", "biases")}
    tensor(ck, names["weight"])
    scales = tensor(ck, names["scales"], f"MLX {fmt.kind} needs .weight and .scales")
    if names["biases"] in ck.store:
        raise FormatError(f"{names['biases']}: unexpected for MLX {fmt.kind} (affine only)")
    words = matrix(ck, names["weight"], np.uint32, f"[out, in*{bits}/32] for {fmt.spell()}")
    out_features, in_features = words.shape[0], words.shape[1] * 32 // bits
    fmt.check_read_shape(out_features, in_features, names["weight"])
    # Little-endian words are the bytes in element order.
    raw = words.astype("<u4", copy=False).view(np.uint8)
    weight = raw if bits == 4 else raw.view(ml_dtypes.float8_e4m3fn)
    bufs = {"weight": weight, "scales": scales}
    fmt.check_buffers(bufs, out_features, in_features, where=module)
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _axes(config: Mapping[str, Any]) -> Axes:
    # codes [O, I*bits/32], one scale per 32 inputs [O, I/32]
    return {**OUT_IN, "scales": ("out", "in")}


register_convention(QuantConvention("mlx_mx", matches_config, _linear, axes=_axes))
