"""compressed-tensors float formats: `mxfp4-pack-quantized` (MXFP4: `weight_packed` u8 [O, I/2],
`weight_scale` E8M0 u8 [O, I/32]) and `float-quantized` (FP8 E4M3 per channel or per tensor, or
per 128 x 128 block: FP8_BLOCK, `weight_scale` [ceil(O/128), ceil(I/128)]).

The matcher claims a config only when every config group has one of these formats (the other
compressed-tensors formats have their own conventions). Schemes of these formats that qir cannot
run are refused when the checkpoint is opened, with "not supported: ..." naming the key.
Activation quantization in a scheme (FP8_DYNAMIC, FP8, MXFP4) is not applied: qir runs these
weights with 16-bit activations (see qir.formats.fp8 / qir.formats.mx).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats.mx import GROUP_SIZE, Mxfp4
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import matrix, tensor
from qir.models.quant_conventions.compressed_tensors import (
    config_groups,
    ct_config,
    group_format,
    target_group,
)
from qir.models.quant_conventions.dense import is_excluded, read_dense, stored_dense
from qir.models.quant_conventions.fp8 import read_fp8
from qir.models.quant_conventions.fp8_block import block_axes, block_size, read_fp8_block
from qir.types import QWeight

MXFP4 = "mxfp4-pack-quantized"
FP8 = "float-quantized"
FP8_STRATEGIES = ("channel", "tensor")
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def _check_scheme(q: Mapping[str, Any]) -> None:
    """Refuses, by name, what these formats can express but qir does not run."""
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise FormatError(
            f"not supported: compressed-tensors quantization_status {status!r} "
            "(only compressed checkpoints; quantization_config.quantization_status)"
        )
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise FormatError(
                f"not supported: compressed-tensors {key} (quantization_config.{key})"
            )
    for name, group in config_groups(q).items():
        where = f"quantization_config.config_groups.{name}.weights"
        w = group.get("weights")
        if not isinstance(w, Mapping):
            raise FormatError(f"{where}: missing")
        fmt = group_format(q, group)
        kind = (w.get("type"), w.get("num_bits"), bool(w.get("symmetric", True)))
        strategy = w.get("strategy")
        if fmt == MXFP4:
            if kind != ("float", 4, True) or w.get("group_size") not in (None, GROUP_SIZE):
                raise FormatError(
                    f"not supported: {MXFP4} weights {w.get('type')} {w.get('num_bits')}-bit "
                    f"group_size {w.get('group_size')} ({where}; MXFP4 is float 4-bit, 32)"
                )
        elif strategy == "block" and kind == ("float", 8, True):
            block_size(w.get("block_structure"), f"{where}.block_structure")
        elif kind != ("float", 8, True) or strategy not in FP8_STRATEGIES:
            raise FormatError(
                f"not supported: {FP8} weights {w.get('type')} {w.get('num_bits')}-bit "
                f"strategy {strategy!r} ({where}; qir runs symmetric FP8 per channel or tensor)"
            )


def matches_config(config: Mapping[str, Any]) -> bool:
    q = ct_config(config)
    if q is None:
        return False
    groups = config_groups(q)
    if not groups or any(group_format(q, g) not in (MXFP4, FP8) for g in groups.values()):
        return False
    _check_scheme(q)
    return True


def _mxfp4(ck: CheckpointView, module: str) -> Linear:
    packed_name, scale_name = f"{module}.weight_packed", f"{module}.weight_scale"
    packed = matrix(ck, packed_name, np.uint8, "[out, in/2]")
    scales = tensor(ck, scale_name, "MXFP4 needs an E8M0 scale per 32 inputs")
    if scales.dtype == _E8M0:  # newer writers store torch.float8_e8m0fnu: the same bytes
        scales = scales.view(np.uint8)
    fmt = Mxfp4()
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    fmt.check_read_shape(out_features, in_features, packed_name)
    bufs = {"weight": packed, "scales": scales}
    try:
        fmt.check_buffers(bufs, out_features, in_features, where=module)
    except FormatError as e:
        msg = str(e).replace(f"{module}.scales:", f"{scale_name}:")
        raise FormatError(msg.replace(f"{module}.weight:", f"{packed_name}:")) from None
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _linear(ck: CheckpointView, module: str) -> Linear:
    q = ct_config(ck.config)
    assert q is not None  # the convention matched on it
    if f"{module}.weight" not in ck.store and f"{module}.weight_packed" not in ck.store:
        raise FormatError(
            f"{module}: no such linear in {ck.path} (no {module}.weight or .weight_packed)"
        )
    found = target_group(q, module)
    # Ignored and untargeted modules are stored unquantized, and so are 16/32-bit `.weight`s the
    # "Linear" target seems to cover but that are not Linears (embeddings).
    if (
        is_excluded(module, q.get("ignore"))
        or found is None
        or stored_dense(ck, module, "weight_packed")
    ):
        return read_dense(ck, module)
    _, group = found
    if group_format(q, group) == MXFP4:
        return _mxfp4(ck, module)
    w = group["weights"]
    if w["strategy"] == "block":
        return read_fp8_block(ck, module, block_size(w["block_structure"], ""), "weight_scale")
    return read_fp8(ck, module, w["strategy"])


def _axes(config: Mapping[str, Any]) -> Axes:
    # weight [O, I] (FP8) or weight_packed [O, I/2] (MXFP4); weight_scale [O, 1] per channel,
    # [O/128, I/128] per block, [O, I/32] per MXFP4 group
    q = ct_config(config) or {}
    weights = [g.get("weights") or {} for g in config_groups(q).values()]
    strategies = {w.get("strategy") for w in weights}
    scale: tuple[str, ...] = ("out", "in")
    if strategies <= {"channel", "tensor"}:
        scale = ("out", "")
    elif strategies == {"block"}:
        blocks = {block_size(w.get("block_structure"), "") for w in weights}
        # one block shape, else every linear is read whole and cut
        scale = block_axes(blocks.pop())["weight_scale"] if len(blocks) == 1 else ("out?", "in?")
    oi = ("out", "in")
    return {**OUT_IN, "weight_packed": oi, "weight_scale": scale, "weight_shape": ("shape",)}


register_convention(QuantConvention("ct_float", matches_config, _linear, axes=_axes))
