"""NVFP4 checkpoints from ModelOpt, compressed-tensors (`nvfp4-pack-quantized`) and mlx-lm
(`mode: nvfp4`), all read into the one `Nvfp4` kernel layout (see qir/formats/nvfp4.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats import mlx
from qir.formats.nvfp4 import GROUP_SIZE, MLX_GLOBAL_DIVISOR, Nvfp4
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import matrix, modelopt_quant, tensor
from qir.models.quant_conventions.compressed_tensors import config_groups, ct_config, group_format
from qir.models.quant_conventions.dense import is_excluded, read_dense, stored_dense
from qir.types import QWeight

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
CT_FORMAT = "nvfp4-pack-quantized"
# Kernel-layout buffer -> checkpoint tensor, per producer (for error messages).
_MODELOPT_NAMES = {"block_scale": "weight_scale", "global_scale": "weight_scale_2"}
_CT_NAMES = {
    "weight": "weight_packed",
    "block_scale": "weight_scale",
    "global_scale": "weight_global_scale",
    "input_scale": "input_global_scale",
}
_MLX_NAMES = {"block_scale": "scales"}


def _scalar(ck: CheckpointView, name: str, what: str) -> np.ndarray:
    """A float32 per-tensor scale ([] or [1]) as the kernel layout's f32 [1]."""
    a = tensor(ck, name, what)
    if a.dtype != np.float32 or a.size != 1:
        raise FormatError(f"{name}: {a.dtype} {list(a.shape)}, expected one float32 ({what})")
    return a.reshape(1)


def _read(
    ck: CheckpointView,
    module: str,
    fmt: Nvfp4,
    packed: np.ndarray,
    block_scale: np.ndarray,
    global_scale: np.ndarray,
    input_scale: np.ndarray | None,
    names: dict[str, str],
) -> Linear:
    """Linear of checkpoint tensors; `names` maps kernel-layout buffers to checkpoint names so
    that an error names the tensor as the checkpoint spells it."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    fmt.check_read_shape(out_features, in_features, f"{module}.weight")
    bufs = {"weight": packed, "block_scale": block_scale, "global_scale": global_scale}
    if input_scale is not None:
        bufs["input_scale"] = input_scale
    try:
        fmt.check_buffers(bufs, out_features, in_features, where=module)
    except FormatError as e:
        msg = str(e)
        for buffer, name in names.items():
            msg = msg.replace(f"{module}.{buffer}:", f"{module}.{name}:")
        raise FormatError(msg) from None
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _read_stored(
    ck: CheckpointView, module: str, fmt: Nvfp4, producer: str, names: dict[str, str]
) -> Linear:
    """Linear of a checkpoint that stores the kernel layout's buffers as they are (ModelOpt,
    compressed-tensors) under the names `names` (buffer -> tensor, where they differ)."""

    def name(buffer: str) -> str:
        return f"{module}.{names.get(buffer, buffer)}"

    input_scale = None
    if fmt.act_bits == 4:
        input_scale = _scalar(ck, name("input_scale"), f"{producer} W4A4 activation scale")
    packed = matrix(
        ck, name("weight"), np.uint8, "[out, in/2]", "the packed E2M1 codes, two per byte"
    )
    block_scale = matrix(
        ck, name("block_scale"), _E4M3, "[out, in/16]", "the E4M3 block scales, one per 16 inputs"
    )
    kind = "decode" if fmt.scale_mode == "mul" else "encode"
    global_scale = _scalar(ck, name("global_scale"), f"{producer} per-tensor {kind} scale")
    return _read(
        ck, module, fmt, packed, block_scale.view(np.uint8), global_scale, input_scale, names
    )


def _check_group_size(value: Any, where: str) -> None:
    if value is not None and value != GROUP_SIZE:
        raise FormatError(f"{where}: group_size {value!r}, NVFP4 needs {GROUP_SIZE}")


# --- ModelOpt --------------------------------------------------------------------------------


def _modelopt_matches(config: Mapping[str, Any]) -> bool:
    q = modelopt_quant(config)
    return q is not None and q.get("quant_algo") == "NVFP4"


def _modelopt_linear(ck: CheckpointView, module: str) -> Linear:
    q = modelopt_quant(ck.config)
    assert q is not None  # the convention matched on it
    # ModelOpt lists paths and globs ("lm_head", "model.layers.*.self_attn*"); an unlisted
    # module with a 16/32-bit `.weight` and no block scales is unquantized all the same.
    if is_excluded(module, q.get("ignore", q.get("exclude_modules"))) or stored_dense(
        ck, module, "weight_scale"
    ):
        return read_dense(ck, module)
    _check_group_size(q.get("group_size"), "quantization.group_size")
    act_bits = 4  # ModelOpt's quant_algo NVFP4 is W4A4 (its weight-only variant has another name)
    for name, group in (q.get("config_groups") or {}).items():
        _check_group_size(group.get("weights", {}).get("group_size"), f"config_groups.{name}")
        if not group.get("input_activations"):
            act_bits = 16
    return _read_stored(ck, module, Nvfp4("mul", act_bits), "ModelOpt", _MODELOPT_NAMES)


# --- compressed-tensors ----------------------------------------------------------------------


def _ct_group(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    q = ct_config(config)
    if q is None:
        return None
    groups = config_groups(q).items()
    return next(((n, g) for n, g in groups if group_format(q, g) == CT_FORMAT), None)


def _ct_matches(config: Mapping[str, Any]) -> bool:
    return _ct_group(config) is not None


def _ct_linear(ck: CheckpointView, module: str) -> Linear:
    found = _ct_group(ck.config)
    assert found is not None  # the convention matched on it
    name, group = found
    q = ct_config(ck.config)
    assert q is not None
    # `ignore` holds paths and `re:` regexes; modules stored at 16/32 bits without weight_packed
    # are the ones no group targets (or not Linears: embeddings).
    if is_excluded(module, q.get("ignore")) or stored_dense(ck, module, "weight_packed"):
        return read_dense(ck, module)
    where = f"quantization_config.config_groups.{name}"
    _check_group_size((group.get("weights") or {}).get("group_size"), f"{where}.weights")
    acts = group.get("input_activations")
    if acts:
        _check_group_size(acts.get("group_size"), f"{where}.input_activations")
        if acts.get("num_bits") != 4:
            raise FormatError(
                f"{where}.input_activations: num_bits {acts.get('num_bits')!r}, NVFP4 W4A4 needs 4"
            )
    return _read_stored(ck, module, Nvfp4("div", 4 if acts else 16), "CT", _CT_NAMES)


# --- MLX -------------------------------------------------------------------------------------


def _mlx_matches(config: Mapping[str, Any]) -> bool:
    q = mlx.quantization_dict(config)
    return q is not None and q.get("mode") == "nvfp4"


def _mlx_linear(ck: CheckpointView, module: str) -> Linear:
    qcfg = mlx.quantization_dict(ck.config)
    assert qcfg is not None  # the convention matched on it
    found = mlx.module_quantization(qcfg, module)
    if found is None:  # mlx-lm left this module unquantized
        return read_dense(ck, module)
    params, where = found
    if params.get("mode") != "nvfp4":
        raise FormatError(
            f"not supported: MLX mode {params.get('mode')} in an nvfp4 checkpoint ({where})"
        )
    if params.get("bits") not in (None, 4):
        raise FormatError(f"{where}.bits: {params.get('bits')!r}, MLX nvfp4 needs 4")
    _check_group_size(params.get("group_size"), where)
    words = matrix(
        ck, f"{module}.weight", np.uint32, "[out, in/8]", "the packed E2M1 codes, eight per uint32"
    )
    scales = tensor(ck, f"{module}.scales", "the E4M3 block scales as uint8")
    if scales.dtype != np.uint8:
        raise FormatError(f"{module}.scales: dtype {scales.dtype}, expected uint8 (E4M3 bits)")
    # mlx's `global_scale` is the tensor amax; dense layers usually have none (decode factor 1).
    if f"{module}.global_scale" in ck.store:
        amax = _scalar(ck, f"{module}.global_scale", "MLX nvfp4 tensor amax")
        global_scale = (amax / MLX_GLOBAL_DIVISOR).astype(np.float32)
    else:
        global_scale = np.ones(1, np.float32)
    # Little-endian words are the bytes in element order: byte k holds elements 2k, 2k+1.
    packed = np.ascontiguousarray(words).astype("<u4", copy=False).view(np.uint8)
    global_scale.flags.writeable = False  # like every buffer read from the checkpoint
    return _read(ck, module, Nvfp4("mul", 16), packed, scales, global_scale, None, _MLX_NAMES)


def _axes(config: Mapping[str, Any]) -> Axes:
    # codes [O, I/2] (or packed in uint32 words), one E4M3 scale per 16 inputs; the per-tensor
    # scales are shared by every shard
    oi = ("out", "in")
    return {**OUT_IN, "weight_packed": oi, "weight_scale": oi, "scales": oi}


register_convention(
    QuantConvention("nvfp4_modelopt", _modelopt_matches, _modelopt_linear, axes=_axes)
)
register_convention(
    QuantConvention("nvfp4_compressed_tensors", _ct_matches, _ct_linear, axes=_axes)
)
register_convention(QuantConvention("nvfp4_mlx", _mlx_matches, _mlx_linear, axes=_axes))
