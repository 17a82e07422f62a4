"""compressed-tensors `pack-quantized` int checkpoints (W4A16/W8A16): `<module>.weight_packed`,
`.weight_scale`, `.weight_shape`, read as stored (see qir.formats.ct_int).

Other compressed-tensors formats (nvfp4/mxfp4/float) have their own conventions; this matcher only
claims configs whose every config group is `pack-quantized` with int weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.formats import ct_int
from qir.formats.base import dtype_among
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import expect_matrix, tensors
from qir.models.quant_conventions.compressed_tensors import (
    config_groups,
    ct_config,
    group_format,
    target_group,
)
from qir.models.quant_conventions.dense import is_excluded, read_dense, stored_dense
from qir.types import QWeight

_NEEDS = "a pack-quantized linear needs weight_packed, weight_scale"


def _is_pack_quantized_int(q: Mapping[str, Any], group: Mapping[str, Any]) -> bool:
    weights = group.get("weights")
    return (
        group_format(q, group) == "pack-quantized"
        and isinstance(weights, Mapping)
        and weights.get("type") == "int"
        and weights.get("num_bits") in ct_int.BITS
    )


def matches_config(config: Mapping[str, Any]) -> bool:
    q = ct_config(config)
    if q is None:
        return False
    groups = config_groups(q)
    return bool(groups) and all(_is_pack_quantized_int(q, g) for g in groups.values())


def _group_of(q: Mapping[str, Any], module: str) -> tuple[Mapping[str, Any], str] | None:
    """The `weights` scheme of the config group that quantizes `module`, and where it is; None
    for a module the config leaves unquantized (ignored, or targeted by no group)."""
    found = None if is_excluded(module, q.get("ignore")) else target_group(q, module)
    if found is None:
        return None
    name, group = found
    weights = group["weights"]
    assert isinstance(weights, Mapping)  # matches_config checked it
    return weights, f"quantization_config.config_groups.{name}.weights"


def _ct_linear(ck: CheckpointView, module: str) -> Linear:
    q = ct_config(ck.config)
    assert q is not None  # the convention matched on it
    found = _group_of(q, module)
    # Ignored and untargeted modules are stored unquantized, and so are 16/32-bit `.weight`s the
    # "Linear" target seems to cover but that are not Linears (embeddings).
    if found is None or stored_dense(ck, module, "weight_packed"):
        return read_dense(ck, module)
    w, where = found
    if w.get("symmetric") is False:
        raise FormatError(f"not supported: compressed-tensors asymmetric int ({where}.symmetric)")
    if w.get("actorder") == "group":
        raise FormatError(f"not supported: compressed-tensors actorder group ({where}.actorder)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise FormatError(f"not supported: compressed-tensors int strategy {strategy} ({where})")
    bits = w["num_bits"]
    packed, scale = f"{module}.weight_packed", f"{module}.weight_scale"
    words, scales = tensors(ck, module, ("weight_packed", "weight_scale"), _NEEDS)
    expect_matrix(words, packed, np.int32, f"[out, in*{bits}/32]")
    out_features, in_features = words.shape[0], words.shape[1] * 32 // bits
    if f"{module}.weight_shape" in ck.store:
        shape = ck.store.get(f"{module}.weight_shape")
        if [int(v) for v in np.asarray(shape).ravel()] != [out_features, in_features]:
            raise FormatError(
                f"{module}.weight_shape: {np.asarray(shape).tolist()}, but weight_packed holds "
                f"[{out_features}, {in_features}] (padded rows are not supported)"
            )
    group_size = in_features if strategy == "channel" else w.get("group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise FormatError(f"{where}.group_size: expected an integer, got {group_size!r}")
    scale_dtype = dtype_among(scales.dtype, ct_int.SCALE_DTYPES, scale)
    fmt = ct_int.CtInt(bits, group_size, scale_dtype)
    fmt.check_read_shape(out_features, in_features, packed)
    bufs = {"weight": words.view(np.uint32), "scales": scales}
    want = fmt.buffers(out_features, in_features)["scales"].shape
    if tuple(bufs["scales"].shape) != want:
        raise FormatError(
            f"{scale}: shape {list(bufs['scales'].shape)}, expected {list(want)} "
            f"(group size {group_size})"
        )
    if not np.all(np.isfinite(bufs["scales"].astype(np.float32))):
        raise FormatError(f"{scale}: contains NaN or Inf")
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _axes(config: Mapping[str, Any]) -> Axes:
    # codes [O, I*bits/32], one scale per group [O, I/g], or per channel [O, 1] (every K part's;
    # where the config mixes strategies, "in" by 1 is not in proportion, so a per-channel
    # linear is read whole and cut), weight_shape [out, in]
    q = ct_config(config) or {}
    schemes = [g.get("weights") or {} for g in config_groups(q).values()]
    channel = bool(schemes) and all(w.get("strategy") == "channel" for w in schemes)
    oi = ("out", "in")
    scale = ("out", "") if channel else oi
    return {**OUT_IN, "weight_packed": oi, "weight_scale": scale, "weight_shape": ("shape",)}


register_convention(QuantConvention("ct_int", matches_config, _ct_linear, axes=_axes))
